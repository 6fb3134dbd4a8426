"""``cosdistill demo``: distill a small teacher language model into a half-width student with the fused loss.

The data are token sequences from a random sparse Markov chain (every token has a few likely
successors), made from the seed, so there is something to learn. The teacher, a tiny GRU language
model initialised at random, is first trained briefly with plain cross-entropy; then a student of half
its width is distilled from it with ``fused_linear_cosine_distill`` (hard cross-entropy on the next
token plus the soft cosine between student and teacher logits) or, with ``--loss jsd``, with
``fused_linear_jsd`` (the soft term the generalized JSD of GKD). A second student from the same start and
the same batches trains on the hard term alone, so the soft term's share is seen rather than assumed. The
students' top-1 agreement with the teacher on held-out sequences is measured before and after, and the loss
curves are drawn in a PNG.
"""

import contextlib
import copy
import dataclasses
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..api import FUSED_LOSSES

SUCCESSORS = 16  # likely next tokens per token in the Markov chain
HELD_OUT_SEQUENCES = 64
LEARNING_RATE = 3e-3
DEFAULT_BETA = {"cosine": 1.0, "jsd": 0.5}  # the soft term's weight for cosine; GKD's mixing weight for jsd


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 200  # distillation steps
    teacher_steps: int = 200  # cross-entropy steps that train the teacher first
    vocab: int = 512
    hidden: int = 128  # the teacher's width; the student's is half
    batch_size: int = 32  # sequences per step
    seq_len: int = 64
    weight_hard: float = 0.5
    weight_soft: float = 0.5
    beta: float | None = None  # None: DEFAULT_BETA of the loss
    seed: int = 0
    loss: str = "cosine"

    def __post_init__(self):
        minimums = dict(steps=1, teacher_steps=0, vocab=SUCCESSORS, hidden=2, batch_size=1, seq_len=2)
        for name, minimum in minimums.items():
            if getattr(self, name) < minimum:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(self, name)}")
        if self.loss not in FUSED_LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(FUSED_LOSSES)}, got {self.loss}")

    @property
    def soft_beta(self) -> float:
        return DEFAULT_BETA[self.loss] if self.beta is None else self.beta

    def soft_term(self) -> str:
        if self.loss == "jsd":
            return f"generalized JSD (beta {self.soft_beta:g}) of student and teacher"
        return f"{self.soft_beta:g} × (1 − cos(student logits, teacher logits))"

    def describe(self) -> str:
        return (
            f"{self.loss} loss, GRU language models, teacher H={self.hidden}, student H={self.hidden // 2}, V={self.vocab}, "
            f"{self.batch_size} sequences x {self.seq_len} tokens per step, seed {self.seed}"
        )


class MarkovChain:
    """Each token is followed by one of SUCCESSORS tokens, drawn at random, with random probabilities."""

    def __init__(self, vocab, generator):
        self.next_tokens = torch.rand(vocab, vocab, generator=generator).topk(SUCCESSORS, dim=1).indices
        self.probs = torch.softmax(2 * torch.randn(vocab, SUCCESSORS, generator=generator), dim=1)

    def sample(self, batch, length, generator) -> torch.Tensor:
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, len(self.probs), (batch,), generator=generator)
        for position in range(1, length):
            previous = tokens[:, position - 1]
            choice = torch.multinomial(self.probs[previous], 1, generator=generator)[:, 0]
            tokens[:, position] = self.next_tokens[previous, choice]
        return tokens


class TinyCausalLM(torch.nn.Module):
    """Token embedding -> GRU -> LM head (no bias): the final hidden states and the head feed the loss."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def hidden_states(self, tokens):
        return self.gru(self.embedding(tokens))[0]

    def forward(self, tokens):
        return self.head(self.hidden_states(tokens))


@dataclass
class DemoResult:
    device: str
    teacher_accuracy: float  # next-token top-1 accuracy on the held-out sequences
    agreement_before: float  # student argmax == teacher argmax, on the held-out sequences
    agreement_after: float
    agreement_hard_only: float  # the same start and batches, trained on the hard term alone
    seconds: float
    total: list[float]  # per distillation step
    soft: list[float]
    hard: list[float]


def run_demo(config: DemoConfig, device: torch.device) -> DemoResult:
    """Trains the teacher, then distills the student, with tqdm progress bars on stderr."""
    start = time.perf_counter()
    with one_cpu_thread():
        chain = MarkovChain(config.vocab, torch.Generator().manual_seed(config.seed))
        held_out = chain.sample(HELD_OUT_SEQUENCES, config.seq_len, torch.Generator().manual_seed(config.seed + 1)).to(device)
        batches = torch.Generator().manual_seed(config.seed + 2)
        torch.manual_seed(config.seed)  # the models' initial weights
        teacher = TinyCausalLM(config.vocab, config.hidden).to(device)
        student = TinyCausalLM(config.vocab, config.hidden // 2).to(device)

        train_teacher(teacher, chain, batches, config, device)
        agreement_before = top1_agreement(student, teacher, held_out)
        hard_only_student, hard_only_batches = copy.deepcopy(student), torch.Generator().set_state(batches.get_state())
        curves = distill(student, teacher, chain, batches, config, device)
        hard_only = dataclasses.replace(config, weight_hard=1.0, weight_soft=0.0)
        distill(hard_only_student, teacher, chain, hard_only_batches, hard_only, device, "student (hard term alone)")
        return DemoResult(
            device=str(device),
            teacher_accuracy=next_token_accuracy(teacher, held_out),
            agreement_before=agreement_before,
            agreement_after=top1_agreement(student, teacher, held_out),
            agreement_hard_only=top1_agreement(hard_only_student, teacher, held_out),
            seconds=time.perf_counter() - start,
            **curves,
        )


@contextlib.contextmanager
def one_cpu_thread():
    """The models are too small for intra-op threads to help, and on a busy CPU the threads wait on each
    other: the default run took 105 s with 2 threads and 32 s with 1 on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_teacher(teacher, chain, batches, config: DemoConfig, device):
    """Plain next-token cross-entropy on full logits; the teacher is frozen afterwards."""
    optimizer = torch.optim.Adam(teacher.parameters(), lr=LEARNING_RATE)
    bar = progress_bar(config.teacher_steps, "teacher (CE)")
    for _ in bar:
        tokens = chain.sample(config.batch_size, config.seq_len, batches).to(device)
        loss = F.cross_entropy(teacher(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    teacher.requires_grad_(False)


def distill(student, teacher, chain, batches, config: DemoConfig, device, description="student (distill)"):
    """Trains the student on the fused loss; returns its total, soft and hard loss per step."""
    optimizer = torch.optim.Adam(student.parameters(), lr=LEARNING_RATE)
    curves = dict(total=[], soft=[], hard=[])
    bar = progress_bar(config.steps, description)
    for _ in bar:
        tokens = chain.sample(config.batch_size, config.seq_len, batches).to(device)
        with torch.no_grad():
            teacher_hidden = teacher.hidden_states(tokens)[:, :-1]
        losses = FUSED_LOSSES[config.loss](
            student.hidden_states(tokens)[:, :-1], student.head.weight, teacher_hidden, teacher.head.weight,
            tokens[:, 1:], weight_hard_loss=config.weight_hard, weight_soft_loss=config.weight_soft,
            beta=config.soft_beta, return_soft_hard_loss=True,
        )
        optimizer.zero_grad()
        losses[0].backward()
        optimizer.step()
        for curve, value in zip(curves.values(), losses):
            curve.append(value.item())
        bar.set_postfix(loss=f"{curves['total'][-1]:.3f}", refresh=False)
    return curves


def progress_bar(steps, description):
    from tqdm.auto import tqdm

    return tqdm(range(steps), desc=description, unit="step", file=sys.stderr)


@torch.no_grad()
def next_token_accuracy(model, tokens) -> float:
    return (model(tokens[:, :-1]).argmax(-1) == tokens[:, 1:]).float().mean().item()


@torch.no_grad()
def top1_agreement(student, teacher, tokens) -> float:
    return (student(tokens).argmax(-1) == teacher(tokens).argmax(-1)).float().mean().item()


def summary(result: DemoResult, config: DemoConfig, plot_path: str) -> str:
    return "\n".join([
        f"cosdistill demo on {result.device}: {config.describe()}",
        f"teacher: {config.teacher_steps} cross-entropy steps, next-token accuracy {result.teacher_accuracy:.1%} "
        f"on {HELD_OUT_SEQUENCES} held-out sequences",
        f"student: {config.steps} distillation steps, last loss {result.total[-1]:.3f} "
        f"(hard {result.hard[-1]:.3f}, soft {result.soft[-1]:.4f})",
        f"student top-1 agreement with the teacher: {result.agreement_before:.1%} before, {result.agreement_after:.1%} after "
        f"({result.agreement_hard_only:.1%} trained on the hard term alone)",
        f"{result.seconds:.1f} s; loss curves in {plot_path}",
    ]) + "\n"


def write_plot(result: DemoResult, config: DemoConfig, path: str):
    """A PNG: the total, hard and soft loss vs distillation step (log scale), and the agreement before/after."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    steps = range(1, len(result.total) + 1)
    axes.plot(steps, result.total, label=f"total = {config.weight_hard:g} × hard + {config.weight_soft:g} × soft")
    axes.plot(steps, result.hard, label="hard: cross-entropy on the next token")
    axes.plot(steps, result.soft, label=f"soft: {config.soft_term()}")
    axes.set(yscale="log", xlabel="distillation step", ylabel="loss")
    axes.set_title(
        f"student top-1 agreement with the teacher: {result.agreement_before:.1%} before, "
        f"{result.agreement_after:.1%} after distillation\n({result.agreement_hard_only:.1%} trained on the hard term alone)"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.suptitle(f"cosdistill demo on {result.device}: {config.describe()}", fontsize=8)
    figure.savefig(path, dpi=120)
