"""`tritonllm launch` with a longer wait for readiness.

The CLI gives Triton 300 s to load the models; on a loaded 2-core machine loading `tensorrt_llm`
(weights plus the kernel build on a first start) took longer. Same parser, same options, same
`launch()`; only `--ready-timeout` is added.
"""

import argparse
import sys

from tritonllm.triton.launcher import add_arguments, launch, options_from_args

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds Triton may take to get ready")
add_arguments(parser)
args = parser.parse_args()
sys.exit(launch(options_from_args(args), ready_timeout_s=args.ready_timeout))
