"""The rank keys of a ModelRunner's violations and the ``{rank}`` value of its KVCANARY_REPORT path."""

from __future__ import annotations


def runner_ranks(runner) -> tuple[dict[str, int], int]:
    """The rank keys every violation of ``runner`` carries, and the ``{rank}`` value of its KVCANARY_REPORT path.

    Keys (sglang ``ModelRunner`` attributes): ``tp_rank`` always; ``pp_rank`` when ``pp_size`` > 1;
    ``attn_dp_rank`` (``runner.dp_rank``) with ``--enable-dp-attention`` and ``dp_size`` > 1; ``dp_rank``
    (``runner.dp_rank``: the replica of ``--dp-size N`` without DP attention, or ``SGLANG_DP_RANK``) when it is
    set and not the only replica's 0.

    ``{rank}`` is the process's index among all TP/PP/DP scheduler processes, so per-rank files never collide:
    ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank`` with ``dp_rank`` counted only for DP replicas (with
    DP attention ``tp_rank`` is already global). With one pipeline stage and one replica it is ``tp_rank``.
    """
    server_args = runner.server_args
    tp_rank = int(getattr(runner, "tp_rank", 0) or 0)
    tp_size = max(int(getattr(runner, "tp_size", 1) or 1), 1)
    pp_rank = int(getattr(runner, "pp_rank", 0) or 0)
    pp_size = max(int(getattr(runner, "pp_size", 1) or 1), 1)
    dp_rank = getattr(runner, "dp_rank", None)
    dp_size = max(int(getattr(server_args, "dp_size", 1) or 1), 1)
    rank = {"tp_rank": tp_rank}
    if pp_size > 1:
        rank["pp_rank"] = pp_rank
    replica = 0
    if dp_rank is not None:
        if getattr(server_args, "enable_dp_attention", False):
            if dp_size > 1:
                rank["attn_dp_rank"] = int(dp_rank)
        elif dp_size > 1 or int(dp_rank) != 0:
            replica = int(dp_rank)
            rank["dp_rank"] = replica
    return rank, (replica * pp_size + pp_rank) * tp_size + tp_rank
