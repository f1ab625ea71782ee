"""Triton paged-attention and KV-write kernels, run on CPU by the Triton interpreter, against the torch
references in engine.kernels.reference (which are themselves checked against dense causal SDPA); the fused
residual add + RMSNorm against the model's own add and RMSNorm; the fused mixture-of-experts matmuls against
the torch path's expert loop (engine.moe); the fp8 weights' matmul against its dequantized weight."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.kernels import reference as ref
from engine.kernels import triton_available
from engine.kv_cache import KVCache

# @triton.jit, and triton.language's own jitted helpers (tl.sum, tl.max, tl.cdiv), choose between GPU
# compilation and the CPU interpreter when they are decorated, i.e. at the process's first `import
# triton`; so the variable is set before that import and stays set (one mode per process).
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
# Absent where it has no wheel (the test extra installs it on Linux only), or failing its own import:
# either way the whole file skips. (engine.kernels imports triton only here, inside triton_available.)
if not triton_available():
    pytest.skip("triton is not importable here", allow_module_level=True)

from engine.kernels.common import interpreting  # noqa: E402

if not interpreting():
    pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module; run this file in "
                "its own process", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.kernels import _tile, common  # noqa: E402
from engine.kernels.kv_write import write_kv  # noqa: E402
from engine.kernels.paged_decode import paged_decode_attention  # noqa: E402
from engine.kernels.paged_prefill import paged_prefill_attention  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # reproducible inputs; tolerances hold for any seed


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def make_tables(lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Distinct, shuffled blocks per sequence (so block order != position order), padded with -1,
    which would fault if a kernel ever read past a sequence's last block."""
    need = [(n + block_size - 1) // block_size for n in lens]
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(need) + 1
    rows, used = [], 0
    for k in need:
        rows.append(perm[used:used + k] + [-1] * (width - k))
        used += k
    return torch.tensor(rows, dtype=torch.int32)


def blocks_for(lens: list[int], block_size: int) -> int:
    return sum((n + block_size - 1) // block_size for n in lens) + 2


def cu_seqlens(chunk_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(chunk_lens).cumsum(0).tolist(), dtype=torch.int32)


def layer_config(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    """A two-layer model shape, for caches laid out exactly as the engine's KVCache."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=64,
                       num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, H, D] rows of plain causal attention (the model's no-prefix SDPA call)."""
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                       v.float().transpose(0, 1)[None], is_causal=True, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


# ---- the references against dense attention ------------------------------------------------------

def test_reference_write_kv_puts_each_row_at_its_block_and_offset():
    k_cache, v_cache = torch.zeros(2, 6, 4, 2, 8)  # 6 blocks of 4
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ref.ref_write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 2]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 2], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # the -1 row wrote nothing


@pytest.mark.parametrize("prefix", [0, 13, 16])
def test_reference_prefill_equals_dense_causal_attention(prefix: int):
    n, bs, scale = 37, 8, 0.3
    q, k, v = torch.randn(n, 8, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    k_cache, v_cache = torch.zeros(2, 12, bs, 2, 16)
    table = make_tables([n], bs, 12, seed=1)
    ref.ref_write_kv(k, v, k_cache, v_cache, (table[0, torch.arange(n) // bs] * bs + torch.arange(n) % bs))
    out = ref.ref_paged_prefill(q[prefix:], k_cache, v_cache, table, cu_seqlens([n - prefix]),
                                torch.tensor([n]), scale)
    torch.testing.assert_close(out, dense_causal(q, k, v, scale)[prefix:], atol=1e-5, rtol=1e-5)


def test_reference_decode_equals_last_row_of_dense_attention():
    bs, scale, lens = 4, 0.25, [1, 4, 9]
    k_cache, v_cache = torch.zeros(2, blocks_for(lens, bs), bs, 1, 16)
    tables = make_tables(lens, bs, k_cache.shape[0], seed=2)
    qs, expected = [], []
    for b, n in enumerate(lens):
        q, k, v = torch.randn(n, 4, 16), torch.randn(n, 1, 16), torch.randn(n, 1, 16)
        pos = torch.arange(n)
        ref.ref_write_kv(k, v, k_cache, v_cache, tables[b, pos // bs] * bs + pos % bs)
        qs.append(q[-1])
        expected.append(dense_causal(q, k, v, scale)[-1])
    out = ref.ref_paged_decode(torch.stack(qs), k_cache, v_cache, tables, torch.tensor(lens), scale)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)


# ---- KV write -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8])
def test_write_kv_matches_reference_and_skips_negative_slots(dtype: torch.dtype, block_size: int):
    num_blocks, heads, d = 5, 2, 64
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))[:11]
    slots[[2, 7]] = -1
    k, v = torch.randn(11, heads, d).to(dtype), torch.randn(11, heads, d).to(dtype)
    k_cache, v_cache = make_cache(num_blocks, block_size, heads, d, dtype)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    ref.ref_write_kv(k, v, k_exp, v_exp, slots)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def test_write_kv_takes_strided_rows_casts_and_writes_a_layer_view():
    """K/V as the model makes them (column slices of one packed qkv matrix, float32) into one layer of
    an fp16 KVCache: nothing else changes. (fp16, not bf16: the interpreter truncates fp32 -> bf16 where
    a GPU rounds to nearest even, so only the fp16 cast is bit-exact on both.)"""
    cache = KVCache(layer_config(num_heads=4, num_kv_heads=2, head_dim=16), num_blocks=4, block_size=4,
                    dtype="float16", device="cpu")
    qkv = torch.randn(6, 4 * 16 + 2 * 2 * 16)
    k, v = qkv[:, 64:96].view(6, 2, 16), qkv[:, 96:].view(6, 2, 16)
    slots = torch.tensor([3, 4, 5, 12, 0, 15])
    write_kv(k, v, cache.data[1, 0], cache.data[1, 1], slots)
    expected = torch.zeros_like(cache.data)
    ref.ref_write_kv(k, v, expected[1, 0], expected[1, 1], slots)
    assert torch.equal(cache.data, expected)


# ---- decode -------------------------------------------------------------------------------------

DECODE_LENS = [1, 15, 16, 17, 32, 33, 50]  # 1, and lengths at and just past block boundaries


def dropped_behind(tables: torch.Tensor, first_keys: list[int], block_size: int) -> torch.Tensor:
    """``tables`` with every block wholly before each row's first visible key set to -1, as a sliding-window
    sequence gives them back (the kernels must never read them)."""
    tables = tables.clone()
    for row, first in enumerate(first_keys):
        tables[row, :max(first, 0) // block_size] = -1
    return tables


def run_decode(lens: list[int], q_heads: int, kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype = torch.float32, window: int = 0, softcap: float = 0.0, **kwargs) -> None:
    k_cache, v_cache = make_cache(blocks_for(lens, block_size), block_size, kv_heads, head_dim, dtype)
    tables = make_tables(lens, block_size, k_cache.shape[0])
    q = torch.randn(len(lens), q_heads, head_dim).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    read = dropped_behind(tables, [n - window for n in lens], block_size) if window else tables
    out = paged_decode_attention(q, k_cache, v_cache, read, context_lens, scale, window=window, softcap=softcap,
                                 **kwargs)
    assert_close(out, ref.ref_paged_decode(q, k_cache, v_cache, tables, context_lens, scale, window, softcap))


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_mixed_lengths_matches_reference(q_heads: int, kv_heads: int, head_dim: int):
    run_decode(DECODE_LENS, q_heads, kv_heads, head_dim, block_size=16, block_n=32)


def test_decode_block_size_8_with_tiles_spanning_blocks():
    run_decode([1, 7, 8, 9, 40], 8, 2, 64, block_size=8, block_n=32)


def test_decode_block_size_32_wider_than_tile():
    run_decode([1, 31, 32, 33, 70], 8, 2, 64, block_size=32, block_n=16)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_decode_split_k_merges_to_the_same_result(num_splits: int):
    """Two-stage decode; the short contexts leave some splits empty, which the merge must ignore."""
    run_decode([1, 16, 17, 100, 150], 8, 2, 64, block_size=16, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_in_a_sliding_window_reads_only_its_last_positions(num_splits: int):
    """Contexts shorter than, equal to and past the window (at and off block boundaries), split-K too; the
    blocks wholly behind each window are -1 in the tables, which the kernel must never read."""
    run_decode([1, 20, 21, 40, 77, 150], 8, 2, 64, block_size=8, window=20, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 32)])
def test_prefill_in_a_sliding_window_matches_reference(block_m: int, block_n: int):
    """Fresh prompts longer than the window (rows whose first key tiles they cannot see), chunks after
    cached prefixes past the window with the blocks behind it given back, and a chunk within it."""
    run_prefill([40, 17, 5, 3], [0, 30, 51, 4], 8, 2, 64, block_size=8, window=20, block_m=block_m,
                block_n=block_n)


def test_decode_non_power_of_two_head_dim():
    run_decode([1, 17, 33], 6, 2, 80, block_size=16)
    run_decode([5, 40], 6, 2, 80, block_size=16, num_splits=2, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_half_precision_within_tolerance(dtype: torch.dtype, num_splits: int):
    run_decode([1, 17, 64], 8, 2, 128, block_size=16, dtype=dtype, num_splits=num_splits, block_n=32)


def test_decode_writes_into_given_out_and_reads_kvcache_layer_views():
    """Layer 1 of a real KVCache, int64 tables and lengths (what the runner builds today), out= given."""
    cache = KVCache(layer_config(num_heads=8, num_kv_heads=2, head_dim=64), num_blocks=8, block_size=16,
                    dtype="float32", device="cpu")
    cache.data.normal_()
    lens = torch.tensor([3, 40])
    tables = make_tables(lens.tolist(), 16, 8, seed=4).long()
    k_cache, v_cache = cache.data[1, 0], cache.data[1, 1]
    q = torch.randn(2, 8, 64)
    out = torch.full_like(q, float("nan"))
    assert paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out) is out
    assert_close(out, ref.ref_paged_decode(q, k_cache, v_cache, tables, lens, 0.125))


# ---- prefill ------------------------------------------------------------------------------------

def run_prefill(chunk_lens: list[int], prefix_lens: list[int], q_heads: int, kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype = torch.float32, window: int = 0,
                softcap: float = 0.0, **kwargs) -> None:
    seq_lens = [p + c for p, c in zip(prefix_lens, chunk_lens, strict=True)]
    k_cache, v_cache = make_cache(blocks_for(seq_lens, block_size), block_size, kv_heads, head_dim, dtype)
    tables = make_tables(seq_lens, block_size, k_cache.shape[0])
    q = torch.randn(sum(chunk_lens), q_heads, head_dim).to(dtype)
    cu, lens = cu_seqlens(chunk_lens), torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    read = dropped_behind(tables, [p - window + 1 for p in prefix_lens], block_size) if window else tables
    out = paged_prefill_attention(q, k_cache, v_cache, read, cu, lens, scale, window=window, softcap=softcap,
                                  **kwargs)
    assert_close(out, ref.ref_paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, window, softcap))


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_mixed_prefixes_matches_reference(q_heads: int, kv_heads: int, head_dim: int):
    """Fresh prompts and chunks after cached prefixes (at and past block boundaries) in one batch."""
    run_prefill([1, 16, 17, 5, 3], [0, 0, 15, 16, 33], q_heads, kv_heads, head_dim, block_size=16,
                block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_256_with_its_default_tiles_matches_reference(dtype: torch.dtype):
    """Gemma 3's heads (256 wide, one KV head for four query heads, a sliding window) on the smaller tiles
    such heads default to (``common.default_tile``): decode and prefill after cached prefixes."""
    from engine.kernels.common import default_tile

    assert default_tile(dtype, 256) == default_tile(dtype, 128) // 2
    run_decode([1, 17, 40], 4, 1, 256, block_size=16, dtype=dtype, window=24)
    run_prefill([16, 5, 1], [0, 17, 33], 4, 1, 256, block_size=16, dtype=dtype, window=24)


@pytest.mark.parametrize("window", [0, 24])
def test_soft_capped_scores_match_reference(window: int):
    """Gemma 2's attention logit soft-capping (a cap of 0.5, which every score of these random heads passes,
    so an uncapped kernel differs): decode, split-K decode and prefill after cached prefixes, with and without
    its sliding window."""
    run_decode([1, 17, 40], 8, 2, 64, block_size=16, window=window, softcap=0.5)
    run_decode([1, 17, 40], 8, 2, 64, block_size=16, window=window, softcap=0.5, num_splits=2)
    run_prefill([16, 5, 1], [0, 17, 33], 8, 2, 64, block_size=16, window=window, softcap=0.5)


def test_prefill_without_prefix_small_tiles_cross_blocks():
    run_prefill([40, 1, 9], [0, 0, 0], 8, 2, 64, block_size=16, block_m=16, block_n=32)


def test_prefill_block_size_8_default_tiles():
    run_prefill([20, 8, 1], [12, 0, 9], 8, 2, 64, block_size=8)


def test_prefill_non_power_of_two_head_dim():
    run_prefill([7, 18], [0, 10], 6, 3, 80, block_size=16, block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision_within_tolerance(dtype: torch.dtype):
    run_prefill([17, 4], [0, 20], 8, 2, 128, block_size=16, dtype=dtype, block_m=16, block_n=16)


# ---- together: write, prefill in chunks, decode ---------------------------------------------------

def test_chunked_prefill_then_decode_equals_dense_attention():
    """One sequence the way the runner drives it: write each chunk's K/V, attend, then decode steps;
    every output row equals plain causal attention over the whole sequence."""
    n, bs, scale = 45, 16, 64 ** -0.5
    q, k, v = torch.randn(n, 8, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)
    k_cache, v_cache = torch.zeros(2, 6, bs, 2, 64)
    table = make_tables([n], bs, 6, seed=5)
    slots = table[0, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
    rows = []
    for begin, end in [(0, 17), (17, 40)]:
        write_kv(k[begin:end], v[begin:end], k_cache, v_cache, slots[begin:end])
        rows.append(paged_prefill_attention(q[begin:end], k_cache, v_cache, table, cu_seqlens([end - begin]),
                                            torch.tensor([end], dtype=torch.int32), scale, block_m=16,
                                            block_n=16))
    for p in range(40, n):
        write_kv(k[p:p + 1], v[p:p + 1], k_cache, v_cache, slots[p:p + 1])
        context_lens = torch.tensor([p + 1], dtype=torch.int32)
        rows.append(paged_decode_attention(q[p:p + 1], k_cache, v_cache, table, context_lens, scale,
                                           block_n=16))
    torch.testing.assert_close(torch.cat(rows), dense_causal(q, k, v, scale), atol=2e-5, rtol=1e-5)


def test_triton_available_is_false_when_triton_cannot_import(monkeypatch):
    from engine.kernels import triton_available

    triton_available.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    try:
        assert triton_available() is False
    finally:
        triton_available.cache_clear()


def test_this_file_skips_cleanly_without_triton(tmp_path: Path):
    """Where triton is missing (no wheel off Linux) or broken, this file skips instead of erroring."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('triton hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
                            cwd=Path(__file__).parents[1], env={**os.environ, "PYTHONPATH": path},
                            capture_output=True, text=True, timeout=120)
    # a module-level skip collects no test: NO_TESTS_COLLECTED on its own, not an error
    assert result.returncode in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED), result.stdout + result.stderr
    assert "1 skipped" in result.stdout and "triton is not importable" in result.stdout, result.stdout


# ---- residual add fused with RMSNorm --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 80])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama-norm", "gemma-norm"])
def test_fused_add_rms_norm_matches_the_model_add_then_rmsnorm(dtype: torch.dtype, hidden: int, gemma: bool):
    """The decoder layer's ``h = h + out`` then ``RMSNorm(h)`` (engine.model; Gemma's scales by its float32
    weight before the cast): the residual is updated in place and the normalized rows come out; rows of wider
    tensors (strided ``x`` and ``out``) work."""
    from engine.kernels.add_rms_norm import fused_add_rms_norm
    from engine.model import RMSNorm

    norm = RMSNorm(hidden, 1e-5, dtype, gemma)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
    x = torch.randn(7, 3, hidden).to(dtype)[:, 0]  # rows 3 * hidden apart
    residual = (3 * torch.randn(7, hidden)).to(dtype)
    expected_h = residual + x
    with torch.no_grad():
        expected = norm(expected_h)
    wide = torch.randn(7, 2, hidden).to(dtype)
    out = fused_add_rms_norm(x, residual, norm.weight, 1e-5, out=wide[:, 1], scale_first=gemma)
    assert out.data_ptr() == wide[:, 1].data_ptr()
    # the bf16 sum differs by its last bit where the interpreter truncates instead of rounding (see above)
    h_tol = dict(atol=0, rtol=0) if dtype != torch.bfloat16 else dict(atol=0.02, rtol=0.01)
    torch.testing.assert_close(residual, expected_h, **h_tol)
    assert_close(out, expected)


def test_fused_add_rms_norm_rejects_mismatched_shapes():
    from engine.kernels.add_rms_norm import fused_add_rms_norm

    with pytest.raises(ValueError, match="must be"):
        fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 8).half(), torch.ones(8), 1e-6)


# ---- RoPE in place ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 1, 128), (3, 3, 80)])
def test_rope_in_place_matches_the_model_rotation(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int):
    """q and k as the model has them (strided views of one fused qkv row), rotated in place exactly as
    ``x * cos + rotate_half(x) * sin`` at scattered positions; v, next to them in memory, untouched."""
    from engine.kernels.rope import apply_rope
    from engine.model import rope_cos_sin, rotate_half

    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                  kv_heads * head_dim], dim=-1))
    positions = torch.tensor([0, 1, 2, 7, 8, 100, 511, 512, 1000, 4095, 3])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    want_q, want_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    v_before = v.clone()
    apply_rope(q, k, cos, sin)
    # float32 is exact; 16-bit dtypes round once here, after each operation in torch
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(v, v_before)


def test_rope_rejects_mismatched_shapes():
    from engine.kernels.rope import apply_rope

    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="cos"):
        apply_rope(q, k, torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    with pytest.raises(ValueError, match="even head_dim"):
        apply_rope(q, torch.randn(2, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16))


# ---- quantized caches: int8 and fp8 codes dequantized in the tile --------------------------------

def quantized_layer_and_reference(kv_format: str, lens: list[int], dtype: torch.dtype, block_size: int = 8):
    """Layer 1 of a real quantized KVCache holding random K/V for sequences of ``lens`` written through the
    cache's own quantizing writer (fp8, kivi2: each last, partial block stays in its window, and kivi2's
    default residual keeps the full block before it there too), returned as
    (block tables, the kernels' codes and QuantizedKV, and the torch path's dequantized dense K and V)."""
    from engine.kv_format import residual_blocks
    from engine.kv_quant import decode_into
    from engine.triton_attention import quantized_layer

    cfg = layer_config(num_heads=8, num_kv_heads=2, head_dim=64)
    num_blocks = blocks_for(lens, block_size)
    cache = KVCache(cfg, num_blocks, block_size, dtype, "cpu", kv_format, residual_blocks=residual_blocks(kv_format))
    tables = make_tables(lens, block_size, num_blocks)
    slots = torch.cat([tables[b, torch.arange(n) // block_size].long() * block_size
                       + torch.arange(n) % block_size for b, n in enumerate(lens)])
    layers = cache.for_step(slots, [(tables[b].tolist(), 0, n) for b, n in enumerate(lens)])
    for layer in layers:
        layer.write(torch.randn(len(slots), 2, 64).to(dtype) * 3, torch.randn(len(slots), 2, 64).to(dtype))
    if cache.windows is not None:  # a record behind a window holds garbage: the kernels must not read it
        for block in (cache.windows.slot_of >= 0).nonzero().flatten().tolist():
            cache.data[1, 0, block] = 0x7F  # NaN as an fp8 code or fp16 scale byte pair
    k_codes, v_codes, quant = quantized_layer(layers[1])
    dense = []
    for kind in (0, 1):
        out = torch.empty(num_blocks, block_size, 2, 64, dtype=dtype)
        decode_into(cache.layout, cache.data[1, 0], "kv"[kind], out)
        if cache.windows is not None:
            cache.windows.overlay(1, kind, torch.arange(num_blocks), out)
        dense.append(out)
    return tables, (k_codes, v_codes, quant), dense


def read_fp8_as_bytes(kv_format: str, monkeypatch) -> str:
    """"fp8-bytes": fp8, its codes read as bytes (``QUANT`` 3), as on GPUs before sm_89."""
    if kv_format == "fp8-bytes":
        monkeypatch.setattr(common, "fp8_codes_as_bytes", lambda device: True)
        return "fp8"
    return kv_format


@triton.jit
def _e4m3_bytes_kernel(Bytes, Out):
    offs = tl.arange(0, 256)
    tl.store(Out + offs, _tile._e4m3_bytes_as_half(tl.load(Bytes + offs)).to(tl.float32) * 256.0)


def test_fp8_codes_read_as_bytes_decode_to_every_finite_value_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    _e4m3_bytes_kernel[(1,)](codes, out)
    want = codes.view(torch.float8_e4m3fn).float()
    finite = want.isfinite()  # 0x7F and 0xFF are NaN, which no quantizer writes
    assert finite.sum() == 254 and torch.equal(out[finite], want[finite])
    assert torch.equal(torch.signbit(out[finite]), torch.signbit(want[finite]))  # -0.0 (0x80) included


@pytest.mark.parametrize("kv_format", ["int8", "fp8", "fp8-bytes", "kivi2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_a_quantized_cache_like_its_dequantized_copy(kv_format: str, dtype: torch.dtype,
                                                                   monkeypatch):
    kv_format = read_fp8_as_bytes(kv_format, monkeypatch)
    lens = [1, 7, 8, 9, 30]  # partial and full blocks of 8: fp8/kivi2 read windows and records in one tile
    tables, (k_codes, v_codes, quant), (k_ref, v_ref) = quantized_layer_and_reference(kv_format, lens, dtype)
    if kv_format != "int8":
        # 1, 7, 9 and 30 are partial; kivi2's residual keeps the full block before each (8's only one) too
        windows = 7 if kv_format == "kivi2" else 4
        assert quant.window_slot is not None and (quant.window_slot >= 0).sum() == windows
    q = torch.randn(len(lens), 8, 64).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    for splits in (1, 2):
        out = paged_decode_attention(q, k_codes, v_codes, tables, context_lens, 0.125, num_splits=splits,
                                     block_n=16, quant=quant)
        assert_close(out, ref.ref_paged_decode(q, k_ref, v_ref, tables, context_lens, 0.125))


@pytest.mark.parametrize("kv_format", ["int8", "fp8", "fp8-bytes", "kivi2"])
def test_prefill_reads_a_quantized_cache_like_its_dequantized_copy(kv_format: str, monkeypatch):
    kv_format = read_fp8_as_bytes(kv_format, monkeypatch)
    seq_lens, chunk_lens = [12, 17, 30], [12, 5, 9]  # a fresh prompt and chunks after cached prefixes
    tables, (k_codes, v_codes, quant), (k_ref, v_ref) = quantized_layer_and_reference(kv_format, seq_lens,
                                                                                      torch.float32)
    q = torch.randn(sum(chunk_lens), 8, 64)
    cu, lens = cu_seqlens(chunk_lens), torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_prefill_attention(q, k_codes, v_codes, tables, cu, lens, 0.125, block_m=16, block_n=16,
                                  quant=quant)
    assert_close(out, ref.ref_paged_prefill(q, k_ref, v_ref, tables, cu, lens, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_write_quantizes_like_the_torch_writer_bit_for_bit(dtype: torch.dtype):
    """The write kernel's int8 codes and fp16 scales equal ``kv_quant.write_tokens``' exactly (ties rounded
    to even, an all-zero head scaled by 1), and a slot of -1 writes nothing."""
    from engine.kv_quant import write_tokens
    from engine.triton_attention import quantized_layer

    cfg = layer_config(num_heads=8, num_kv_heads=2, head_dim=64)
    caches = [KVCache(cfg, 6, 8, dtype, "cpu", "int8") for _ in range(2)]
    for cache in caches:
        cache.data.random_(0, 256, generator=torch.Generator().manual_seed(1))  # stale bytes everywhere
    k, v = torch.randn(7, 2, 64).to(dtype) * 5, torch.randn(7, 2, 64).to(dtype)
    k[0, 0] = torch.arange(64).to(dtype) * 0.5 + 0.25  # with amax 63.5 the scale is 0.5: x / 0.5 = n + 0.5,
    k[0, 0, 0] = -63.5  # a tie for every code but this one
    k[1, 1] = 0  # an all-zero head
    slots = torch.tensor([3, 9, 17, -1, 40, 41, 47])
    layers = caches[0].for_step(slots)
    k_codes, v_codes, quant = quantized_layer(layers[1])
    write_kv(k, v, k_codes, v_codes, slots, quant=quant)
    keep = slots >= 0
    write_tokens(caches[1].layout, caches[1].data[1, 0], slots[keep] // 8, slots[keep] % 8, k[keep], v[keep])
    assert torch.equal(caches[0].data, caches[1].data)


def test_quantized_operands_are_checked():
    from engine.kernels.common import QuantizedKV

    codes = torch.zeros(4, 8, 2, 64, dtype=torch.int8)
    scale = torch.ones(4, 8, 2, 1, dtype=torch.float16)
    q, tables, lens = torch.randn(1, 8, 64), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="float16"):
        paged_decode_attention(q, codes, codes, tables, lens, 0.1, quant=QuantizedKV(scale.float(), scale))
    with pytest.raises(ValueError, match="torch.int8 or torch.float8"):
        paged_decode_attention(q, codes.float(), codes.float(), tables, lens, 0.1, quant=QuantizedKV(scale, scale))
    window = torch.zeros(2, 8, 2, 64)
    with pytest.raises(ValueError, match="window_slot"):
        paged_decode_attention(q, codes, codes, tables, lens, 0.1,
                               quant=QuantizedKV(scale, scale, k_window=window, v_window=window))
    packed = torch.zeros(4, 8, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="k_zero"):  # kivi2 codes with scales [.., 3]: 3 does not divide 64
        paged_decode_attention(q, packed, packed, tables, lens, 0.1,
                               quant=QuantizedKV(scale, scale, scale.expand(4, 8, 2, 3), scale))
    with pytest.raises(ValueError, match="uint8"):  # int8 codes with zero points
        paged_decode_attention(q, codes, codes, tables, lens, 0.1, quant=QuantizedKV(scale, scale, scale, scale))
    with pytest.raises(ValueError, match="dtype"):  # codes without their scales
        paged_decode_attention(q, codes, codes, tables, lens, 0.1)


def route_randomly(tokens: int, hidden: int, experts: int, top_k: int, skip: int = 0):
    """Router inputs and its top-k, with the last ``skip`` experts never chosen (runs of length 0)."""
    from engine.moe import route

    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, experts)
    logits[:, experts - skip:] = -1e9
    scores, ids = route(logits, top_k, renormalize=True)
    return x, scores, ids


@pytest.mark.parametrize("tokens, top_k, block_m", [(1, 2, 16), (37, 3, 16), (200, 2, 64)])
def test_align_by_expert_groups_each_pair_once_in_padded_runs(tokens: int, top_k: int, block_m: int):
    from engine.kernels.moe_experts import align_by_expert

    experts = 8
    _, _, ids = route_randomly(tokens, 4, experts, top_k, skip=2)
    pairs, block_experts = align_by_expert(ids, experts, block_m)
    num_pairs = tokens * top_k
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once, the rest padding
    assert pairs.numel() == block_experts.numel() * block_m  # sized from the token count alone
    for block, expert in enumerate(block_experts.tolist()):
        members = pairs[block * block_m:(block + 1) * block_m]
        members = members[members < num_pairs]
        if expert < 0:
            assert members.numel() == 0
        else:  # each block holds one expert's pairs, in token order
            assert members.numel() > 0 and (ids.flatten()[members] == expert).all()
            assert members.tolist() == sorted(members.tolist())
    used = block_experts[block_experts >= 0]
    assert used.tolist() == sorted(used.tolist()) and (used < experts - 2).all()


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (5, 8, 3), (70, 4, 1), (40, 16, 4)])
@pytest.mark.parametrize("float32_scores", [True, False])
def test_fused_moe_matches_the_expert_loop(tokens: int, experts: int, top_k: int, float32_scores: bool):
    """Hidden and intermediate sizes that are not multiples of the tiles, experts with no tokens, and scores
    in float32 (Mixtral) or the activations' dtype (Qwen)."""
    from engine.kernels.moe_experts import fused_moe
    from engine.moe import routed_experts

    hidden, inter = 48, 40
    x, scores, ids = route_randomly(tokens, hidden, experts, top_k, skip=1)
    if not float32_scores:
        scores = scores.to(x.dtype)
    gate_up, down = torch.randn(experts, 2 * inter, hidden) / 8, torch.randn(experts, hidden, inter) / 8
    assert_close(fused_moe(x, scores, ids, gate_up, down), routed_experts(x, scores, ids, gate_up, down))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_half_precision_within_tolerance(dtype: torch.dtype):
    from engine.kernels.moe_experts import fused_moe
    from engine.moe import routed_experts

    x, scores, ids = route_randomly(9, 64, 8, 2)
    gate_up, down = torch.randn(8, 2 * 32, 64) / 8, torch.randn(8, 64, 32) / 8
    want = routed_experts(x, scores, ids, gate_up, down)
    got = fused_moe(x.to(dtype), scores, ids, gate_up.to(dtype), down.to(dtype))
    assert got.dtype == dtype
    assert_close(got, want.to(dtype))


@pytest.mark.parametrize("k_block", [16, 0])  # 0: one scale a row
@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_on_fp8_experts_matches_the_expert_loop(k_block: int, as_bytes: bool, dtype: torch.dtype,
                                                          monkeypatch):
    """fp8 codes with a scale per row and 16 columns (the last block of 40 narrower) or per row: the fused
    kernels scale each slice's partial sums as the torch loop dequantizes each expert's matrices; the codes
    read natively and as bytes (GPUs before sm_89)."""
    from engine.kernels.common import ExpertQuant
    from engine.kernels.moe_experts import fused_moe
    from engine.moe import routed_experts

    monkeypatch.setattr(common, "fp8_codes_as_bytes", lambda device: as_bytes)
    experts, hidden, inter = 4, 48, 40
    x, scores, ids = route_randomly(11, hidden, experts, 2, skip=1)
    (gate_up, gate_up_scales), (down, down_scales) = (
        fp8_weight(experts * rows, cols, k_block or cols) for rows, cols in ((2 * inter, hidden), (hidden, inter)))
    gate_up, down = gate_up.view(experts, 2 * inter, hidden), down.view(experts, hidden, inter)
    quant = ExpertQuant(gate_up_scales.view(experts, 2 * inter, -1) / 8, down_scales.view(experts, hidden, -1) / 8,
                        k_block or hidden, k_block or inter)  # weights about 1/8, as the tests above
    want = routed_experts(x, scores, ids, gate_up, down, quant).to(dtype)  # float32, as the half-precision test
    assert_close(fused_moe(x.to(dtype), scores, ids, gate_up, down, quant), want)


@pytest.mark.parametrize("bits, group, act_order", [(4, 16, False), (4, 0, False), (4, 16, True), (8, 16, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_on_integer_experts_matches_the_expert_loop(bits: int, group: int, act_order: bool,
                                                              dtype: torch.dtype):
    """4-bit codes two a byte (or 8-bit ones) with a zero and a scale per row and 16 columns (slices of a
    group; 0: one group a row): the fused kernels subtract each slice's zeros and scale its partial sums as
    the torch loop dequantizes each expert's matrices; with act-order each expert gathers its input columns
    in its own order."""
    from engine.kernels.common import ExpertQuant
    from engine.kernels.moe_experts import fused_moe
    from engine.moe import routed_experts

    experts, hidden, inter = 4, 64, 48
    x, scores, ids = route_randomly(11, hidden, experts, 2, skip=1)
    (gate_up, gate_up_scales, gate_up_zeros), (down, down_scales, down_zeros) = (
        [t.view(experts, rows, -1) for t in int_weight(experts * rows, cols, cols // (group or cols), bits)]
        for rows, cols in ((2 * inter, hidden), (hidden, inter)))
    perms = [torch.stack([torch.randperm(cols) for _ in range(experts)]) for cols in (hidden, inter)] if act_order \
        else [None, None]
    quant = ExpertQuant(gate_up_scales / 8, down_scales / 8, group or hidden, group or inter, gate_up_zeros,
                        down_zeros, *perms, bits=bits)  # weights about 1/8, as the tests above
    want = routed_experts(x, scores, ids, gate_up, down, quant).to(dtype)
    assert_close(fused_moe(x.to(dtype), scores, ids, gate_up, down, quant), want)
    if act_order:  # the orders matter: without them the output is another
        assert not torch.allclose(routed_experts(x, scores, ids, gate_up, down, quant._replace(
            gate_up_perm=None, down_perm=None)).to(dtype), want, atol=1e-2)
        with pytest.raises(ValueError, match="both matrices' input orders"):
            fused_moe(x, scores, ids, gate_up, down, quant._replace(down_perm=None))
        with pytest.raises(ValueError, match=r"int64 \[E, 48\]"):
            fused_moe(x, scores, ids, gate_up, down, quant._replace(down_perm=perms[1].int()))
    with pytest.raises(ValueError, match="zeros must be uint8, shaped and strided as their scales"):
        fused_moe(x, scores, ids, gate_up, down, quant._replace(down_zero=down_zeros[:, 1:]))
    with pytest.raises(ValueError, match=r"\[E, 2I, 64\]" + (".*half the columns" if bits == 4 else "")):
        fused_moe(x, scores, ids, gate_up[:, :, :8], down, quant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_on_w8a8_experts_matches_the_expert_loop(dtype: torch.dtype):
    """int8 values with a scale a row times each row of their input quantized to int8 (the tokens' for gate/up,
    each pair's hidden row for down): the kernel's exact int32 sums scaled once equal the loop's w8a8_linear."""
    from engine.kernels.common import ExpertQuant
    from engine.kernels.moe_experts import fused_moe
    from engine.moe import routed_experts

    experts, hidden, inter = 4, 64, 48
    x, scores, ids = route_randomly(21, hidden, experts, 2, skip=1)
    gen = torch.Generator().manual_seed(3)
    gate_up, down = (torch.randint(-128, 128, (experts, rows, cols), generator=gen, dtype=torch.int8)
                     for rows, cols in ((2 * inter, hidden), (hidden, inter)))
    quant = ExpertQuant(torch.rand(experts, 2 * inter, 1, generator=gen) / 500,
                        torch.rand(experts, hidden, 1, generator=gen) / 500, hidden, inter, int8_activations=True)
    want = routed_experts(x.to(dtype), scores, ids, gate_up, down, quant)
    got = fused_moe(x.to(dtype), scores, ids, gate_up, down, quant)
    assert got.dtype == dtype
    assert_close(got, want)
    with pytest.raises(ValueError, match="int8 values"):
        fused_moe(x, scores, ids, gate_up.to(torch.uint8), down.to(torch.uint8), quant)


@pytest.mark.parametrize("rows, cols, dtype", [(5, 64, torch.float32), (3, 2500, torch.bfloat16),
                                               (2, 7, torch.float16)])
def test_int8_rows_are_the_torch_paths_codes_and_scales(rows: int, cols: int, dtype: torch.dtype):
    """Every code and scale bit for bit, a row of zeros included, across more columns than one block (1,024)
    and fewer than one."""
    from engine.kernels.int8_rows import int8_rows
    from engine.w8a8 import quantize_int8_rows

    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 3).to(dtype)
    x[-1] = 0
    codes, scales = int8_rows(x)
    want_codes, want_scales = quantize_int8_rows(x)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert codes[-1].eq(0).all() and (codes[0].abs().max() == 127)


def test_fused_moe_rejects_mismatched_operands():
    from engine.kernels.moe_experts import fused_moe

    x, scores, ids = route_randomly(3, 16, 4, 2)
    gate_up, down = torch.randn(4, 2 * 8, 16), torch.randn(4, 16, 8)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, scores[:, :1], ids, gate_up, down)
    with pytest.raises(ValueError, match=r"\[E, 16, I\]"):
        fused_moe(x, scores, ids, gate_up, down[:, :, :4])
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, scores, ids, gate_up.half(), down.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, cap, fan_in, fan_out", [(1, 16, 64, 48), (7, 24, 200, 130), (33, 48, 96, 320)])
def test_grouped_lora_adds_each_rows_adapter_and_leaves_base_rows_alone(dtype, rows, cap, fan_in, fan_out):
    """Ranks that are not powers of two, fan-ins and fan-outs that are not multiples of the tiles, base-model
    rows (-1) between adapter rows: each row gets its own slot's ``x A^T B^T``, the per-adapter torch path's."""
    from engine.kernels.lora_matmul import lora_grouped
    from engine.lora import lora_delta

    slots = 3
    x = torch.randn(rows, fan_in).to(dtype)
    a, b = torch.randn(slots, cap, fan_in) / 8, torch.randn(slots, fan_out, cap) / 8
    a[2, cap // 2:] = 0  # slot 3 holds an adapter of half the rank, zero past it as LoRASlots leaves it
    index = torch.tensor([(t % (slots + 1)) - 1 for t in range(rows)])
    out = torch.randn(rows, fan_out).to(dtype)
    want = ref.ref_lora_grouped(out, x, a.to(dtype), b.to(dtype), index)
    got = lora_grouped(out.clone(), x, a.to(dtype), b.to(dtype), index)
    assert_close(got, want)
    assert torch.equal(got[index < 0], out[index < 0])  # base rows: not one bit changed
    if dtype == torch.float32:  # the torch path's per-adapter pairs (views of the stacks) agree
        pairs = {s + 1: (a[s], b[s]) for s in range(slots)}
        rows_of = [(s + 1, torch.nonzero(index == s).flatten()) for s in range(slots)]
        assert_close(got, lora_delta(out.clone(), x, pairs, rows_of))


def test_grouped_lora_rejects_mismatched_stacks():
    from engine.kernels.lora_matmul import lora_grouped

    x, out, index = torch.randn(2, 16), torch.randn(2, 8), torch.tensor([0, -1])
    a, b = torch.randn(2, 4, 16), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match=r"A \[slots, cap, in\]"):
        lora_grouped(out, x, a[:, :, :8], b, index)
    with pytest.raises(ValueError, match="contiguous"):
        lora_grouped(out, x, a, b.transpose(1, 2).contiguous().transpose(1, 2), index)


def fp8_weight(n: int, k: int, k_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes spread over e4m3's range (subnormals to 448) and a scale per row and ``k_block`` columns, the
    weights about unit-sized."""
    codes = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, (torch.rand(n, -(-k // k_block)) + 0.01) / 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, k_block", [(1, 48, 64, 64), (5, 96, 80, 32), (33, 40, 96, 16), (17, 70, 256, 128)])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_fp8_matmul_matches_its_dequantized_weight(dtype, m, n, k, k_block, as_bytes, monkeypatch):
    """One scale a row (k_block = K) and block scales, a last block narrower than the others (80 = 2 x 32 +
    16), outputs and rows that are not multiples of the tiles; the codes read natively and, as on GPUs
    before sm_89, as bytes."""
    from engine.kernels.fp8_gemm import fp8_matmul

    monkeypatch.setattr(common, "fp8_codes_as_bytes", lambda device: as_bytes)
    x = torch.randn(m, k).to(dtype)
    codes, scales = fp8_weight(n, k, k_block)
    assert_close(fp8_matmul(x, codes, scales, k_block), ref.ref_fp8_matmul(x, codes, scales, k_block))


def test_fp8_matmul_rejects_mismatched_operands():
    from engine.kernels.fp8_gemm import fp8_matmul

    x = torch.randn(2, 64)
    codes, scales = fp8_weight(8, 64, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(x, codes.float(), scales, 32)
    with pytest.raises(ValueError, match=r"scales must be float32 \[8, 2\]"):
        fp8_matmul(x, codes, scales[:, :1], 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_matmul(x, codes, torch.rand(8, 3), 24)


def int_weight(n: int, k: int, groups: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes over 0 .. 2^bits - 1 (4-bit ones two a byte), a zero in that range and a scale per row and group,
    the weights about unit-sized."""
    return (torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8), (torch.rand(n, groups) + 0.01) / 8
            / 2 ** (bits - 4), torch.randint(0, 1 << bits, (n, groups), dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, groups, bits", [(1, 48, 256, 2, 4), (5, 96, 80, 1, 4), (33, 40, 96, 6, 4),
                                                   (17, 72, 512, 4, 4), (1, 48, 256, 2, 8), (33, 40, 96, 6, 8)])
def test_int_matmul_matches_its_dequantized_weight(dtype, m, n, k, groups, bits):
    """4- and 8-bit codes; groups of 128 (slices narrower than a group in fp32), 16 and one a row (80
    columns: a last slice cut short), outputs and rows that are not multiples of the tiles."""
    from engine.kernels.int_gemm import int_matmul

    x = torch.randn(m, k).to(dtype)
    packed, scales, zeros = int_weight(n, k, groups, bits)
    assert_close(int_matmul(x, packed, scales, zeros, bits), ref.ref_int_matmul(x, packed, scales, zeros, bits))


def test_int_matmul_rejects_mismatched_operands():
    from engine.kernels.int_gemm import int_matmul

    x = torch.randn(2, 64)
    packed, scales, zeros = int_weight(8, 64, 2, 4)
    with pytest.raises(ValueError, match=r"packed 4-bit codes must be uint8 \[8, 32\]"):
        int_matmul(x, packed.int(), scales, zeros, 4)
    with pytest.raises(ValueError, match=r"packed 8-bit codes must be uint8 \[8, 64\]"):
        int_matmul(x, packed, scales, zeros, 8)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        int_matmul(x, packed, scales, zeros, 2)
    with pytest.raises(ValueError, match="one shape"):
        int_matmul(x, packed, scales, zeros[:, :1], 4)
    with pytest.raises(ValueError, match="multiples of 16"):
        int_matmul(x, packed, torch.rand(8, 8), torch.zeros(8, 8, dtype=torch.uint8), 4)
