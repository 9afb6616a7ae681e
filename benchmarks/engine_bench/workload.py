"""What every measurement runs: prompts cut from bundled text, greedy requests, throughput figures."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from tritonllm.engine import SamplingParams

# Prompts are cut from this text (cyclically, from a different offset per request).
CORPUS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
    "rag that had once been a shirt. For thirty years he had trimmed the wick, polished the great lens, "
    "and written the state of the sea in a leather logbook. Ships passed without knowing his name, and he "
    "liked it that way; the light was the only thing that needed to be seen.",
    "Bread is one of the oldest prepared foods. Flour, water, salt and a little yeast are mixed into a "
    "dough, which is kneaded until the gluten forms long elastic strands. The dough rises as the yeast "
    "ferments sugars and releases carbon dioxide, and the trapped gas gives the loaf its open crumb. "
    "Baking sets the structure, browns the crust and drives off most of the alcohol.",
    "In the early days of computing, programs were entered by flipping switches or feeding punched cards "
    "into a reader. A single mistake meant waiting hours for another turn on the machine. Assemblers, "
    "then compilers, let programmers write instructions in a more human form, and time-sharing systems "
    "allowed many people to use the same computer at once from separate terminals.",
    "Rivers shape the land they cross. Over thousands of years, water carries sand and gravel downstream, "
    "cutting valleys in the hills and building wide plains where the current slows. When a river floods, "
    "it spreads fine silt across the fields, which is why so many farming villages grew up along its "
    "banks despite the risk of losing a harvest to high water.",
    "The committee met on a Tuesday to review the budget for the new library. The architect presented "
    "three designs: a glass pavilion, a brick building that matched the old town hall, and a timber "
    "structure with a garden on the roof. After two hours of discussion, the members agreed to ask the "
    "public for comments before making a final decision next month.",
    "Honeybees communicate the location of flowers through a waggle dance performed inside the hive. The "
    "angle of the dance relative to vertical tells the other bees the direction of the food compared "
    "with the sun, while the length of the waggle run encodes the distance. A strong colony can gather "
    "nectar from fields several kilometres away using this simple language.",
    "She packed light for the journey: two shirts, a notebook, a map folded so many times that the creases "
    "had worn through, and a small camera that belonged to her grandmother. The train left before sunrise. "
    "By noon the city had given way to pine forests and lakes so still that the clouds seemed to sit on "
    "the water, and she stopped counting the stations.",
    "A good experiment begins with a clear question and a way to measure the answer. Scientists change one "
    "variable at a time, keep the others fixed, and repeat the measurement to estimate how much the result "
    "varies by chance. Publishing the method in enough detail lets other laboratories try to reproduce the "
    "finding, which is how a surprising claim slowly becomes accepted knowledge.",
]

# Perplexity text (~400 tokens), not part of the prompts.
PERPLEXITY_TEXT = (
    "The old market opened at six in the morning, long before most of the town was awake. Farmers arrived "
    "in small trucks loaded with crates of tomatoes, onions, apples and fresh herbs, and set up their "
    "stalls under striped canvas awnings. The fishmonger laid his catch on beds of crushed ice, and the "
    "baker at the corner pulled the first trays of rolls from the oven, filling the square with the smell "
    "of warm bread.\n\n"
    "By eight o'clock the square was crowded. Parents with children, students on their way to school, and "
    "retired couples moved slowly between the stalls, comparing prices and chatting with the sellers they "
    "had known for years. Some people came only for coffee and conversation; others carried long lists and "
    "left with heavy bags. The market was as much a meeting place as a place to shop.\n\n"
    "In recent years, the town council has debated whether to move the market to a larger covered hall on "
    "the edge of town. Supporters argue that the new site would offer parking, shelter from the rain and "
    "better facilities for the traders. Opponents worry that the move would empty the historic centre, "
    "hurt the small cafes and shops around the square, and break a tradition that has lasted for more than "
    "two hundred years.\n\n"
    "For now, nothing has changed. Every Saturday the awnings go up again, the trucks line the narrow "
    "streets, and the sound of bargaining echoes off the stone walls. When the church bell rings at noon, "
    "the traders begin to pack away what they have not sold, and by one o'clock the square is quiet, "
    "swept clean, and waiting for the next week."
)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int


class PromptSource:
    """Prompts cut cyclically from the tokenized corpus, each starting at an offset not used before."""

    def __init__(self, token_ids: list[int], seed: int):
        self.ids = token_ids
        self.offsets = list(range(len(token_ids)))
        random.Random(seed).shuffle(self.offsets)

    def take(self, length: int) -> list[int]:
        if not self.offsets:
            raise RuntimeError("out of distinct prompt offsets: lengthen CORPUS")
        start = self.offsets.pop()
        return [self.ids[(start + i) % len(self.ids)] for i in range(length)]


def make_requests(
    source: PromptSource,
    prefix: str,
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt_len, max_tokens = rng.randint(*prompt_range), rng.randint(*output_range)
        requests.append(Request(f"{prefix}-{i}", source.take(prompt_len), max_tokens))
    return requests


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class ThroughputResult:
    name: str
    num_requests: int
    useful_output_tokens: int  # tokens the requests asked for
    computed_output_tokens: int  # tokens actually generated (HF: padded to the batch's longest)
    prompt_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_s: list[float]
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def measured(
        cls, name: str, requests: list, computed: int, wall: float, ttft: list[float], **fields
    ) -> ThroughputResult:
        """Derive the rates and percentiles from one run's raw figures."""
        useful = sum(r.max_tokens for r in requests)
        return cls(
            name=name,
            num_requests=len(requests),
            useful_output_tokens=useful,
            computed_output_tokens=computed,
            prompt_tokens=sum(len(r.prompt) for r in requests),
            wall_s=wall,
            output_tokens_per_s=useful / wall,
            ttft_p50_s=percentile(ttft, 50),
            ttft_p95_s=percentile(ttft, 95),
            ttft_s=ttft,
            **fields,
        )
