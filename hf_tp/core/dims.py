"""``ParallelDims``: every size of a parallel layout (tp, dp, dp_replicate, cp, ep, pp and the
pipeline schedule), declared once, with the rules every layout obeys, its world size, the row
length it needs and the device mesh it builds.

The fields carry their help, metavar and choices (:func:`hf_tp.core.setting.setting`): ``hf-tp
train``'s settings group (``hf_tp.run.settings_run``) and the flags of ``hf-tp estimate``,
``plan`` and ``verify`` are generated from them, so each flag has one definition.

Each rule raises one ``ValueError`` before any collective (the numbers alone: every rank raises
the same), naming the sizes as the caller's user wrote them: command-line flags (``flags=True``:
"--ep must divide --dp (3): ..., got 2") or Python arguments ("ep must divide dp (3): ..., got
ep=2"). The model's own rules (tp against heads and widths, ep against the expert count) are the
adapters'. No torch here: the mesh is built by :mod:`hf_tp.core.mesh`, imported on use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_tp.core.setting import setting

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

LAYOUT_DIMS = ("tp", "dp", "ep", "cp", "dp_replicate")
HSDP_DIMS = ("dp_replicate", "dp_shard", "tp")  # the mesh's dims with dp_replicate > 1
SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved1f1b", "loopedbfs", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, rank r holding stages r and 2 pp - 1 - r
MULTI_STAGE = ("interleaved1f1b", "loopedbfs", *V_SHAPED)  # schedules that run several stages per rank


@dataclass(frozen=True)
class ParallelDims:
    """A parallel layout: ``pp x dp x cp x tp`` ranks (pp outermost, tp adjacent), ep borrowed from
    dp x cp, dp = ``dp_replicate`` replicas x an FSDP2 shard group (HSDP); ``pp`` > 1 cuts the
    decoder layers into stages run by ``pp_schedule`` (``pp_virtual_stages`` per rank), a dp rank's
    rows split into ``microbatches`` (None: pp). Checked on construction (Python names); the
    command lines check the same with flag names (:func:`check_dims`)."""

    tp: int = setting(1, "tensor-parallel size; must fit the model's heads", metavar="N")
    dp: int = setting(1, "data-parallel (FSDP2) size; tp*dp processes run", metavar="N")
    ep: int = setting(
        1,
        "expert parallelism for MoE models: each group of N dp ranks splits the experts; must divide "
        "--dp and the expert count",
        metavar="N",
    )
    cp: int = setting(
        1,
        "context parallelism for long sequences: each row's tokens split over N ranks; tp*cp*dp "
        "processes run; rows padded to a multiple of 2*cp*tp",
        metavar="N",
    )
    dp_replicate: int = setting(
        1,
        "HSDP: dp = R replicas x an FSDP2 group of dp/R ranks sharding the weights; gradients are "
        "all-reduced across replicas once per step (put replicas across nodes); must divide --dp",
        metavar="R",
    )
    pp: int = setting(
        1,
        "pipeline parallelism: the decoder layers cut into N stages (outermost, may cross nodes); "
        "pp*tp*dp processes run",
        metavar="N",
    )
    pp_schedule: str = setting("1f1b", "torch's pipeline schedule", choices=SCHEDULE_NAMES)
    microbatches: int | None = setting(
        None,
        "pipeline micro-batches each micro-step's --batch-size rows are split into; at least --pp for 1f1b "
        "(default: pp)",
        metavar="M",
    )
    pp_virtual_stages: int = setting(
        1,
        "stages per rank for --pp-schedule interleaved1f1b or loopedbfs (2 or more), zbv or dualpipev (2)",
        metavar="V",
    )

    def __post_init__(self) -> None:
        for dim in ("tp", "dp"):  # chosen here (a settings group may leave them unset: None)
            check_positive(dim, getattr(self, dim))
        check_dims(self)

    @classmethod
    def of(cls, values: Any) -> ParallelDims:
        """The dims of anything holding these fields (a ``TrainConfig``, an ``EstimateSpec``, a
        parsed command line); an unset (None) tp or dp counts as 1."""
        given = {f.name: getattr(values, f.name) for f in dataclasses.fields(cls) if hasattr(values, f.name)}
        given.update({k: given.get(k) or 1 for k in ("tp", "dp")})
        return cls(**given)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    @property
    def pipeline_microbatches(self) -> int:
        """Pipeline micro-batches per micro-step: ``microbatches``, else pp."""
        return self.microbatches or self.pp

    @property
    def row_multiple(self) -> int:
        """What the collator pads a row to (:func:`row_multiple`)."""
        return row_multiple(self.tp, self.cp)

    def replace(self, **changes: Any) -> ParallelDims:
        return dataclasses.replace(self, **changes)

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The device mesh of this layout over the initialised world, built once (its named slices:
        :class:`hf_tp.core.mesh.MeshSlices`): ``("dp", "tp")``, ``("dp", "cp", "tp")`` with a
        ``"dp_cp"`` dim flattened (FSDP2's), ``("dp_replicate", "dp_shard", "tp")`` with a ``"dp"``
        dim flattened (HSDP), ``"pp"`` outermost when pp > 1 (only stage boundaries cross nodes);
        tp ranks adjacent. ``device_type``: cuda when a GPU is visible, else cpu."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from hf_tp.compat.torch_distributed import flatten_mesh

        if not dist.is_initialized():
            raise ValueError(
                "build_mesh needs an initialised process group: start the ranks with `hf-tp train`, "
                "`torchrun`, `accelerate launch` or accelerate.notebook_launcher"
            )
        check_world(dist.get_world_size(), self.tp, self.dp, self.cp, self.pp)
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        shape, names = self._mesh_shape()
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if self.dp_replicate > 1:  # every dp rank's own rows, as on a ("dp", "tp") mesh
            flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        if self.cp > 1:  # FSDP2's mesh: weights sharded over dp x cp (torchtitan's layout)
            flatten_mesh(mesh["dp", "cp"], "dp_cp")
        return mesh

    def _mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh's sizes and dim names."""
        if self.dp_replicate > 1:
            shape, names = (self.dp_replicate, self.dp // self.dp_replicate, self.tp), HSDP_DIMS
        elif self.cp > 1:
            shape, names = (self.dp, self.cp, self.tp), ("dp", "cp", "tp")
        else:
            shape, names = (self.dp, self.tp), ("dp", "tp")
        if self.pp > 1:
            return (self.pp, *shape), ("pp", *names)
        return shape, names


def check_dims(dims: Any, *, flags: bool = False, layers: int | None = None) -> None:
    """Every rule of a layout held by ``dims`` (a :class:`ParallelDims` or anything with its
    fields; tp or dp None: not chosen yet), and of its pipeline: ``layers`` the model's decoder
    layers when known."""
    check_layout(dims.tp, dims.dp, dims.cp, dims.ep, dims.dp_replicate, flags=flags)
    check_pipeline_dims(dims.pp, dims.pp_schedule, dims.microbatches, dims.pp_virtual_stages, flags, layers)


def check_pipeline_dims(
    pp: int, schedule: str, microbatches: int | None, virtual: int, flags: bool = False, layers: int | None = None
) -> None:
    """``pp`` positive; the pipeline settings only with pp > 1, then as :func:`check_pipeline`."""
    check_positive("pp", pp, flags)
    if microbatches is not None and (isinstance(microbatches, bool) or microbatches < 1):
        raise ValueError(f"{_name('microbatches', flags)} must be a positive integer, got {microbatches!r}")
    if pp == 1:
        if microbatches not in (None, 1) or virtual != 1 or schedule != "1f1b":
            if flags:
                raise ValueError(
                    "--microbatches, --pp-schedule and --pp-virtual-stages are pipeline settings: add --pp N (N > 1)"
                )
            raise ValueError("microbatches, pp_schedule and pp_virtual_stages are pipeline settings: set pp > 1")
        return
    check_pipeline(pp, schedule, microbatches or pp, virtual, layers)


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


def check_world(world: int, tp: int, dp: int, cp: int = 1, pp: int = 1) -> None:
    """The layout covers the world: tp x cp x dp ranks (x pp)."""
    if pp * tp * cp * dp == world:
        return
    if pp > 1:
        raise ValueError(f"world size ({world}) must equal pp*dp*cp*tp ({pp}*{dp}*{cp}*{tp}={pp * dp * cp * tp})")
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


def check_pipeline(pp: int, schedule: str, microbatches: int, virtual: int, layers: int | None = None) -> None:
    """One line for a pipeline setting torch's schedules cannot run (the settings alone: every
    rank raises the same before any collective)."""
    if pp < 1:
        raise ValueError(f"--pp must be a positive integer, got {pp}")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"--pp-schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {schedule!r}")
    if virtual < 1:
        raise ValueError(f"--pp-virtual-stages must be a positive integer, got {virtual}")
    if schedule in V_SHAPED and virtual != 2:
        raise ValueError(
            f"--pp-schedule {schedule} places exactly 2 stages per rank (V-shaped): set --pp-virtual-stages 2"
        )
    if schedule in MULTI_STAGE and virtual < 2:
        raise ValueError(f"--pp-schedule {schedule} runs several stages per rank: set --pp-virtual-stages 2 or more")
    if schedule not in MULTI_STAGE and virtual > 1:
        raise ValueError(
            f"--pp-virtual-stages {virtual} needs --pp-schedule {', '.join(MULTI_STAGE)} ({schedule} runs one stage per rank)"
        )
    if microbatches < 1:
        raise ValueError(f"--microbatches must be a positive integer, got {microbatches}")
    if schedule in ("1f1b", "interleaved1f1b") and pp > 1 and microbatches < pp:
        raise ValueError(
            f"--pp-schedule {schedule} needs at least as many micro-batches as stages' ranks: --microbatches {microbatches} < --pp {pp}"
        )
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ValueError(
            f"--pp-schedule dualpipev needs at least as many micro-batches as stages: --microbatches {microbatches} < {2 * pp}"
        )
    if layers is not None and layers < pp * virtual:
        raise ValueError(_too_many_stages(pp, schedule, virtual, layers))


def _too_many_stages(pp: int, schedule: str, virtual: int, layers: int) -> str:
    """The line for more pipeline stages than decoder layers, with the largest ``--pp`` that fits."""
    if virtual == 1:
        stages = f"--pp {pp}: {pp} stages"
    elif schedule in V_SHAPED:
        stages = f"--pp-schedule {schedule} places 2 stages per rank: --pp {pp} x 2 = {pp * virtual} stages"
    else:
        stages = f"--pp {pp} x --pp-virtual-stages {virtual} = {pp * virtual} stages"
    most = layers // virtual
    fix = f"use --pp {most} or less" if most >= 2 else "use fewer virtual stages, or train with --pp 1"
    if schedule in V_SHAPED and most < 2:
        fix = "use --pp-schedule 1f1b or gpipe, or train with --pp 1"
    return f"{stages} but the model has {layers} decoder layers: at most one stage per layer; {fix}"


def check_tied_schedule(tied: bool, schedule: str) -> None:
    """A weight tied across the first and the last stage (``lm_head`` and the embedding) under a
    V-shaped schedule, which runs both stages on one rank: refused (the two copies are not kept in
    step there yet)."""
    if tied and schedule in V_SHAPED:
        raise ValueError(
            f"--pp-schedule {schedule} runs the first and the last stage on one rank, where a tied lm_head's two "
            "copies are not kept in step yet: use --pp-schedule 1f1b, gpipe, interleaved1f1b or loopedbfs"
        )


def check_pipeline_rows(rows: int | None, microbatches: int, flags: bool = True) -> None:
    """A dp rank's ``rows`` split evenly into the pipeline's micro-batches."""
    if rows is not None and rows % microbatches:
        raise ValueError(
            f"{_name('batch_size', flags)} ({rows}) must be a multiple of {_name('microbatches', flags)} "
            f"({microbatches}): each pipeline micro-batch takes an equal share of a dp rank's rows"
        )


def check_pipeline_layers(dims: Any, layers: int) -> None:
    """Before launch, once the model's config is read: no more pipeline stages (``--pp`` x
    virtual stages) than the model's ``layers`` decoder layers (the ranks check again where they cut)."""
    if dims.pp == 1:
        return
    microbatches = dims.microbatches or dims.pp
    check_pipeline(dims.pp, dims.pp_schedule, microbatches, dims.pp_virtual_stages, layers)
