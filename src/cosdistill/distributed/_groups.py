"""What the data- and vocabulary-parallel pieces ask of a process group they are given."""

import torch.distributed as dist


def check_member(group, caller: str) -> None:
    """A group that does not hold this rank (``new_group`` without it) would size collectives from a rank of -1, or
    fail inside torch with no word of which argument."""
    if dist.get_rank(group) < 0:
        raise ValueError(f"{caller}: this rank (global rank {dist.get_rank()}) is not in the group it was given")
