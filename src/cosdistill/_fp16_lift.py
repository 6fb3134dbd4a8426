"""fp16 storage in the chunk loop (_chunk_loop.py): the row step writes each row's gradient times a power of two
(_row_step.lift_for) so that it does not sink into fp16's subnormals; ``Unlift`` takes those powers back out of
the gradient GEMMs (docs/design.md, fp16 storage scaling)."""

import torch

from ._device import HostCopy, addmm_into

FP16_STORAGE_EXPONENT = 14  # grad_input rows are kept in fp16 with their largest entry in [2^14, 2^15)
SCALED_DOWN_GROUP = 256  # rows of scaled-down gradients widened to fp32 at a time (V x 1 KiB each)


class Unlift:
    """fp16 only: the row step writes each row's gradient times a power of two (_row_step.py, so that
    it does not sink into fp16's subnormals); its inverse goes onto the row's hidden state for
    grad_weight, and onto grad_input's and grad_bias's rows through fp32 (exact: powers of two).
    grad_input then waits for grad_output (a loss scale, say) in fp16, so each of its rows is kept
    times its own power of two too (``grad_input_lifts``), divided out with grad_output in backward.
    Rows whose gradient was scaled down (lift < 1: entries past fp16's range, e.g. a student row of
    norm ~0) cannot move 1 / lift onto their hidden state in fp16: the fp16 GEMMs take them as stored,
    and the rest of their grad_weight and grad_bias terms is added in fp32 (``correct_scaled_down``).
    Their count is copied to the host behind the row step and read once the chunk's GEMMs are
    queued, so the GPU never waits for the host on it."""

    def __init__(self, rows: int, hidden_size: int, num_tokens: int, device: torch.device):
        self.lifts = torch.empty(rows, dtype=torch.float32, device=device)
        self.hidden = torch.empty(rows, hidden_size, dtype=torch.float16, device=device)
        self.grad_input = torch.empty(rows, hidden_size, dtype=torch.float32, device=device)
        self.grad_input_lifts = torch.ones(num_tokens, dtype=torch.float32, device=device)

    def up_lifts(self, rows: int) -> torch.Tensor:
        """The lifts, 1 for scaled-down rows (``correct_scaled_down`` adds the rest of their terms)."""
        return self.lifts[:rows].clamp(min=1.0)

    def hidden_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden / lift, row by row, for the grad_weight GEMM."""
        return torch.div(hidden, self.up_lifts(len(hidden))[:, None].to(hidden.dtype), out=self.hidden[: len(hidden)])

    def count_scaled_down(self, rows: int) -> None:
        """Queue the copy of the number of rows with lift < 1 to the host."""
        self.count = HostCopy((self.lifts[:rows] < 1.0).sum())

    def correct_scaled_down(self, grad_weight, grad_bias, grad_logits, hidden, inv_normaliser, overwrite) -> bool:
        """Add (1 / lift - 1) times the stored gradient of the rows with lift < 1 (the fp16 GEMMs took it
        once, with the undivided hidden state) to grad_weight and grad_bias, in fp32. Whether any."""
        if not self.count.get().item():
            return False
        indices = torch.nonzero(self.lifts[: len(grad_logits)] < 1.0).flatten()
        for group in indices.split(SCALED_DOWN_GROUP):
            rows = grad_logits[group].float() * ((1.0 / self.lifts[group] - 1.0) * inv_normaliser)[:, None]
            if grad_weight is not None:
                addmm_into(grad_weight, rows.t(), hidden[group].float(), alpha=1.0, beta=0.0 if overwrite else 1.0)
                overwrite = False
            if grad_bias is not None:
                grad_bias.add_(rows.sum(0))
        return True

    def grad_input_into(self, grad_input, start, grad_logits, student_weight, inv_normaliser, reduce):
        rows = self.grad_input[: len(grad_logits)]
        addmm_into(rows, grad_logits, student_weight, alpha=1.0, beta=0.0)
        rows.mul_((inv_normaliser / self.lifts[: len(rows)])[:, None])  # the rows for grad_output = 1
        if reduce is not None:  # a vocabulary split: sum in fp32 first, so that every rank picks the same lifts
            reduce(rows)
        abs_max = rows.abs().amax(1)
        exponent = FP16_STORAGE_EXPONENT - torch.floor(torch.log2(abs_max))
        exponent = torch.where((abs_max > 0) & torch.isfinite(abs_max), exponent.clamp(-100, 100), 0.0)
        storage_lifts = torch.ldexp(torch.ones_like(abs_max), exponent.int())
        self.grad_input_lifts[start : start + len(rows)] = storage_lifts
        grad_input[start : start + len(rows)] = rows.mul_(storage_lifts[:, None])

    def add_grad_bias(self, grad_bias, grad_logits, inv_normaliser):
        unlift = (1.0 / self.up_lifts(len(grad_logits))).to(grad_logits.dtype)
        addmm_into(grad_bias[None], unlift[None], grad_logits, alpha=inv_normaliser, beta=1.0)
