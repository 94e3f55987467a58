"""Bit-exact comparison with the golden fixtures: on the fixtures' CPU, and on a CPU that sums differently.

The fixtures hold what the reference computed on one machine's CPU. Its fp32 GEMMs are MKL's, and
MKL splits the reduction dimension into cache blocks whose size depends on the CPU. Measured on
the golden head GEMM (`prefill.head_in` x `head.weight` -> `prefill.logits`, [160, 256] x [512, 256],
every product exact in fp32, so only the order of the additions matters):

- the fixture machine's MKL adds K in two blocks of 128 (each a sequential sum, then the two sums
  added): all 81,920 logits are reproduced that way;
- on an Intel Xeon with AVX-512 and AMX (the CI runners since 2026-12) MKL adds all 256 in one
  sequential run, and 50,793 of the 81,920 logits differ in the last bit. No `MKL_CBWR` branch
  reproduces the fixture machine's blocking.

Every tiny golden model is chaotic by design (golden README section 6), so one ulp in one GEMM
grows into visible differences after a few layers, whatever the port does. Hence:

- :data:`FIXTURE_CPU` runs that probe once per session, with torch's own ``F.linear``, nothing of
  this project's code involved.
- On the fixture CPU (or one that sums the same way) every golden comparison is bit for bit, as
  always: :func:`assert_golden` is ``torch.equal`` plus a message.
- Elsewhere a comparison that is not bit-exact must still stay within the bound the call states (rel
  L2 for floats, the fraction of differing entries for ids and tokens), or the test fails; within it,
  the test is reported **xfailed** with every measured deviation (conftest's report hook), never as
  passed. pytest's header line says which of the two this run is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Bounds off the fixture CPU, from what an Intel AMX runner measured (README "Tests"), with margin:
# one op or one block fed the golden input: last-bit GEMM differences only
LOCAL_REL_L2 = 1e-2
# ids picked from scores so computed (a near-tie flips)
LOCAL_MISMATCH = 0.05
# through the whole model (8 chaotic layers): the last-bit differences have grown (measured: up
# to 0.045 in the logits, 0.14 in an attention output)
CHAIN_REL_L2 = 0.3
# greedy tokens: the first ones must agree; past a flipped near-tie the continuation is another text
TOKENS_PREFIX = 2

# what the tests of the running test item measured off the fixture CPU; the report hook reads it
_deviations: list[str] = []


@functools.cache
def _probe() -> tuple[bool, str]:
    from safetensors.torch import load_file

    from conftest import golden_dir

    folder = golden_dir() / "model_tiny_bf16"
    vl = load_file(folder / "vl.safetensors")
    weight = load_file(folder / "model.safetensors")["head.weight"]
    want = vl["prefill.logits"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the fixtures were made, and as the golden tests run
    try:
        got = F.linear(vl["prefill.head_in"].float(), weight.float())
    finally:
        torch.set_num_threads(threads)
    differ = int((got != want).sum())
    return differ == 0, f"golden head GEMM with this CPU's F.linear: {differ} of {want.numel()} logits differ"


def fixture_cpu() -> bool:
    """True where this CPU's fp32 GEMM reproduces the fixture machine's (the module docstring's probe)."""
    return _probe()[0]


def probe_report() -> str:
    """One line for pytest's header: what the probe found (or that it could not run: the golden
    tests then fail on their own, each naming the missing fixtures)."""
    try:
        same, detail = _probe()
    except (RuntimeError, OSError) as err:  # no fixtures, or an incomplete copy
        return f"fixture CPU: not probed ({err})"
    verdict = "bit-exact golden comparisons" if same else "golden comparisons within stated bounds, reported xfailed"
    return f"fixture CPU: {'yes' if same else 'no'} ({detail}) -> {verdict}"


def take_deviations() -> list[str]:
    """The deviations recorded since the last call (the report hook's read; it also clears)."""
    out = list(_deviations)
    _deviations.clear()
    return out


def record_deviation(what: str) -> None:
    """Note a golden check this CPU could not make; the test is then reported xfailed, not passed."""
    assert not fixture_cpu(), f"{what}: on the fixture CPU every golden check must hold"
    _deviations.append(what)


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)


def assert_golden(
    got: torch.Tensor | Sequence,
    want: torch.Tensor | Sequence,
    what: str,
    *,
    rel_l2: float | None = None,
    mismatch: float | None = None,
    prefix: int = 0,
) -> None:
    """``got`` equals the golden ``want`` bit for bit, or (off the fixture CPU) within a bound.

    Args:
        got, want: tensors, or lists of ids / tokens; shapes and dtypes must agree.
        what: names the boundary in the messages.
        rel_l2: off the fixture CPU, the largest ``||got - want|| / ||want||`` accepted (floats).
        mismatch: off the fixture CPU, the largest fraction of differing entries accepted (ids,
            tokens, or floats where a rel L2 says little).
        prefix: on any CPU, the first `prefix` entries along the last dimension must be equal
            (generated tokens: the first ones come before the chaos has grown).

    Raises:
        AssertionError: shapes or dtypes differ; not bit-exact on the fixture CPU; off it, beyond
            the bound, or no bound given.
    """
    got, want = _as_tensor(got), _as_tensor(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: ours {got.dtype}{tuple(got.shape)} vs golden {want.dtype}{tuple(want.shape)}"
    )
    if torch.equal(got, want):
        return
    assert torch.equal(got[..., :prefix], want[..., :prefix]), f"{what}: the first {prefix} differ"
    differ = (got != want).flatten()
    share = float(differ.float().mean())
    measured = f"{int(differ.sum())} of {differ.numel()} differ"
    if got.is_floating_point():
        err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300))
        measured += f", rel L2 {err:.3g}"
    if fixture_cpu():
        raise AssertionError(f"{what}: not bit-exact ({measured})")
    if rel_l2 is None and mismatch is None and not prefix:
        raise AssertionError(f"{what}: not bit-exact on this CPU ({measured}) and the test states no bound for it")
    if rel_l2 is not None:
        assert got.is_floating_point(), f"{what}: a rel L2 bound needs floats"
        assert err <= rel_l2, f"{what}: {measured}, beyond this CPU's bound rel L2 {rel_l2:g}"
    if mismatch is not None:
        assert share <= mismatch, f"{what}: {measured}, beyond this CPU's bound of {mismatch:.0%} differing"
    record_deviation(f"{what}: {measured}")
