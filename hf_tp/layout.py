"""The rules every layout (tp x cp x dp, ep borrowed from dp x cp, dp_replicate splitting dp) obeys,
defined once for ``hf-tp train`` (:meth:`hf_tp.train.config.TrainConfig.validate`), ``hf-tp
estimate`` and the mesh ``hf_tp.build_mesh`` / ``hf_tp.parallelize`` build (no torch needed).

Each rule raises one ``ValueError`` naming the sizes as the caller's user wrote them: command-line
flags (``flags=True``: "--ep must divide --dp (3): ..., got 2") or Python arguments ("ep must
divide dp (3): ..., got ep=2"). The model's own rules (tp against heads and widths, ep against the
expert count) are the adapters' (:func:`hf_tp.train.validate.validate_model_config`).
"""

from __future__ import annotations

LAYOUT_DIMS = ("tp", "dp", "ep", "cp", "dp_replicate")


def _name(dim: str, flags: bool) -> str:
    return f"--{dim.replace('_', '-')}" if flags else dim


def _given(dim: str, value: object, flags: bool) -> str:
    return f"{value!r}" if flags else f"{dim}={value!r}"


def check_positive(dim: str, value: object, flags: bool = False) -> None:
    """``value`` is an int >= 1 (a bool is not)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{_name(dim, flags)} must be a positive integer, got {_given(dim, value, flags)}")


def check_layout(
    tp: int | None = 1,
    dp: int | None = 1,
    cp: int = 1,
    ep: int = 1,
    dp_replicate: int = 1,
    *,
    flags: bool = False,
) -> None:
    """Every size positive, ep a divisor of dp x cp, dp_replicate a divisor of dp that does not
    meet cp or ep. ``tp``/``dp`` None: not chosen yet (``hf-tp train`` derives dp from the world)."""
    for dim, value in zip(LAYOUT_DIMS, (tp, dp, ep, cp, dp_replicate), strict=True):
        if value is not None:
            check_positive(dim, value, flags)
    if dp is not None:
        check_expert_ranks(dp, cp, ep, flags)
    check_dp_replicate(dp, dp_replicate, cp, ep, flags)


def check_expert_ranks(dp: int, cp: int, ep: int, flags: bool = False) -> None:
    """Expert parallelism borrows its ranks from dp (x cp): ep must divide dp x cp."""
    if ep >= 1 and (dp * cp) % ep == 0:
        return
    what = "dp x cp" if cp > 1 else "dp"
    named = f"{_name('dp', flags)} x {_name('cp', flags)}" if cp > 1 else _name("dp", flags)
    raise ValueError(
        f"{_name('ep', flags)} must divide {named} ({dp * cp}): expert parallelism borrows its ranks from {what}, "
        f"got {_given('ep', ep, flags)}"
    )


def check_dp_replicate(dp: int | None, dp_replicate: int, cp: int = 1, ep: int = 1, flags: bool = False) -> None:
    """HSDP: dp = dp_replicate replicas x an FSDP2 shard group, so dp_replicate divides dp; it
    does not compose with cp or ep here (both fold their ranks into the one FSDP2 dp mesh)."""
    if dp_replicate == 1:
        return
    if dp is not None and dp % dp_replicate:
        raise ValueError(
            f"{_name('dp_replicate', flags)} must divide {_name('dp', flags)} ({dp}): dp = replicas x the FSDP "
            f"shard group, got {_given('dp_replicate', dp_replicate, flags)}"
        )
    if cp > 1 or ep > 1:
        other = _name("cp" if cp > 1 else "ep", flags)
        raise ValueError(f"{_name('dp_replicate', flags)} does not combine with {other} yet: drop one of them")


def check_world(world: int, tp: int, dp: int, cp: int = 1) -> None:
    """The layout covers the world: tp x cp x dp ranks."""
    if tp * cp * dp == world:
        return
    if cp == 1:
        raise ValueError(f"world size ({world}) must equal tp*dp ({tp}*{dp}={tp * dp})")
    raise ValueError(f"world size ({world}) must equal tp*cp*dp ({tp}*{cp}*{dp}={tp * cp * dp})")


def row_multiple(tp: int, cp: int) -> int:
    """A row's length must be a multiple of this: tp (sequence parallelism), 2 x cp x tp with
    context parallelism (each cp rank keeps two equal chunks, each split over tp)."""
    return tp * (2 * cp if cp > 1 else 1)


def check_cp_rows(seq_len: int, tp: int, cp: int, name: str = "seq_len") -> None:
    """Under context parallelism ``seq_len`` splits into 2 x cp chunks, each split over tp."""
    if cp > 1 and seq_len % row_multiple(tp, cp):
        raise ValueError(
            f"{name} ({seq_len}) must be a multiple of 2*cp*tp ({row_multiple(tp, cp)}): each cp rank keeps two "
            "equal chunks of a row, each split over tp"
        )


def check_compile(compile: bool, activation_checkpointing: bool, tp: int) -> None:
    """torch.compile of a decoder layer that HF checkpoints, under tp, fails in torch's compiler
    (its AOT autograd saves the DTensors' DeviceMesh for backward): one line before anything runs."""
    if compile and activation_checkpointing and tp > 1:
        raise ValueError(
            "compile with activation checkpointing fails under tensor parallelism in this torch (its compiler "
            "saves a DeviceMesh for the checkpointed layer's backward): drop --compile or --activation-checkpointing"
        )
