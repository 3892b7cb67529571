"""Float64 reference for Baichuan-M1 (`model_type` baichuan_m1), for the fixtures.

transformers has no Baichuan-M1. The checkpoints ship their own
modeling_baichuan.py (Hugging Face repo baichuan-inc/Baichuan-M1-14B-Instruct,
`trust_remote_code`), which runs only through flash-attn on CUDA. This file
ports that file's ONE full forward pass (no cache) to torch float64 on the CPU,
as a transformers `PreTrainedModel` so that scripts/fixture_lib.py can save and
reload it like any transformers model. What it follows of the original:

- `W_pack` [(H + 2*KV) * D, hidden]: viewed as H + 2*KV heads of D rows; the
  first H are q, the next KV are k, the last KV are v. D = hidden / H, where H,
  KV are `num_swa_attention_heads` / `num_swa_key_value_heads` on the layers in
  `sliding_window_layers` and `num_attention_heads` / `num_key_value_heads`
  elsewhere (so the two kinds have different head_dims);
- `conv_k`, `conv_v` [1, 1, KV, 1, w] (w = conv_window): a causal conv along
  the sequence per KV head, over k and v before RoPE, zero-padded in front:
  out[t] = sum_j K[h, j] * x[t - (w - 1) + j] (`custom_convolution`);
- RoPE on the whole head (flash-attn's non-interleaved rotary; inverse
  frequencies, angles, cos and sin in float32 as the original's caches), base
  rope_theta;
- attention softmax(q k^T / sqrt(D)), causal; sliding layers see the window
  keys j with i - window < j <= i (flash-attn's window_size=(window - 1, 0));
- RMSNorm, SwiGLU MLP, pre-norm residual blocks, final RMSNorm;
- `lm_head` is a NormHead: each vocabulary row of the weight is divided by its
  L2 norm (F.normalize, eps 1e-12) before the product.

The original's incremental path is NOT ported and is wrong for a multi-token
chunk on a non-empty cache: it then takes its one-token decode branch
(`conv[0] * last_k + conv[1] * k` broadcast over the whole chunk, with
`last_k` the previous call's whole chunk) and drops the conv for every token
after the first. The one full pass is the definition this project matches in
every feeding mode (one pass, chunks, decode).

The original asserts conv_window == 2 (its decode branch only handles 2); the
one-pass convolution is defined for any window, and so is this port.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

F64 = torch.float64


class BaichuanM1Config(PretrainedConfig):
    """The original's config keys (configuration_baichuan.py)."""

    model_type = "baichuan_m1"

    def __init__(
        self,
        vocab_size=133120,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=20,
        num_key_value_heads=2,
        num_swa_attention_heads=40,
        num_swa_key_value_heads=8,
        hidden_act="silu",
        max_position_embeddings=32768,
        model_max_length=32768,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_theta=1e6,
        sliding_window=8192,
        sliding_window_layers=None,
        conv_window=2,
        attention_dropout=0.0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_swa_attention_heads = num_swa_attention_heads
        self.num_swa_key_value_heads = num_swa_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.model_max_length = model_max_length
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window
        self.sliding_window_layers = list(sliding_window_layers if sliding_window_layers is not None
                                          else range(1, num_hidden_layers, 2))
        self.conv_window = conv_window
        self.attention_dropout = attention_dropout
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def layer_types(self):
        # Not a config key: what fixture_info.json records.
        return ["sliding_attention" if i in self.sliding_window_layers else "full_attention"
                for i in range(self.num_hidden_layers)]


def heads_of(config, layer_idx: int) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) of a layer, as the original's BaichuanAttention."""
    swa = layer_idx in config.sliding_window_layers
    H = config.num_swa_attention_heads if swa else config.num_attention_heads
    KV = config.num_swa_key_value_heads if swa else config.num_key_value_heads
    return H, KV, config.hidden_size // H


class RMSNorm(torch.nn.Module):
    def __init__(self, dims, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return self.weight.to(F64) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = torch.nn.Linear(h, i, bias=False)
        self.up_proj = torch.nn.Linear(h, i, bias=False)
        self.down_proj = torch.nn.Linear(i, h, bias=False)
        assert config.hidden_act == "silu", "the original's MLP is SwiGLU"

    def forward(self, x):
        g = x @ self.gate_proj.weight.to(F64).T
        u = x @ self.up_proj.weight.to(F64).T
        return (torch.nn.functional.silu(g) * u) @ self.down_proj.weight.to(F64).T


def causal_conv(x, kernel):
    """custom_convolution in float64: x [B, L, KV, D], kernel [1, 1, KV, 1, w]."""
    w = kernel.shape[-1]
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, w - 1, 0))  # [B, L + w - 1, KV, D]
    unfolded = padded.unfold(1, w, 1)  # [B, L, KV, D, w]
    return (unfolded * kernel.to(F64)).sum(-1)


def rope_cos_sin(dim: int, base: float, L: int):
    # The original's caches: inverse frequencies, angles, cos and sin in float32.
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(L, dtype=torch.float32), inv_freq)  # [L, dim/2]
    return freqs.cos().to(F64), freqs.sin().to(F64)


def apply_rope(x, cos, sin):
    """Non-interleaved rotary over the whole head: x [B, L, heads, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.is_swa = layer_idx in config.sliding_window_layers
        self.num_heads, self.num_kv_heads, self.head_dim = heads_of(config, layer_idx)
        assert self.num_heads * self.head_dim == config.hidden_size
        h = config.hidden_size
        self.W_pack = torch.nn.Linear(h, h + 2 * self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(h, h, bias=False)
        w = config.conv_window
        self.conv_k = torch.nn.Parameter(torch.softmax(torch.randn(1, 1, self.num_kv_heads, 1, w), dim=-1))
        self.conv_v = torch.nn.Parameter(torch.softmax(torch.randn(1, 1, self.num_kv_heads, 1, w), dim=-1))

    def forward(self, x):
        B, L, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        proj = (x @ self.W_pack.weight.to(F64).T).view(B, L, H + 2 * KV, D)
        q, k, v = proj[:, :, :H], proj[:, :, H : H + KV], proj[:, :, H + KV :]
        k, v = causal_conv(k, self.conv_k), causal_conv(v, self.conv_v)
        cos, sin = rope_cos_sin(D, self.config.rope_theta, L)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = H // KV
        k = k.repeat_interleave(rep, dim=2)  # q head i reads KV head i // rep (flash-attn's GQA)
        v = v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("blhd,bshd->bhls", q, k) / D**0.5
        i = torch.arange(L)[:, None]
        j = torch.arange(L)[None, :]
        keep = j <= i
        if self.is_swa:
            keep = keep & (j > i - self.config.sliding_window)
        scores = scores.masked_fill(~keep, float("-inf"))
        out = torch.einsum("bhls,bshd->blhd", torch.softmax(scores, dim=-1), v).reshape(B, L, H * D)
        return out @ self.o_proj.weight.to(F64).T


class DecoderLayer(torch.nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class BaichuanModel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = torch.nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class NormHead(torch.nn.Module):
    def __init__(self, hidden_size, vocab_size):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, h, normalize: bool = True):
        w = self.weight.to(F64)
        if normalize:
            w = torch.nn.functional.normalize(w)  # each vocabulary row / max(||row||, 1e-12)
        return h @ w.T


class BaichuanM1ForCausalLM(PreTrainedModel):
    config_class = BaichuanM1Config
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        if config.tie_word_embeddings:
            raise ValueError("this port covers untied heads only (the released checkpoints)")
        self.model = BaichuanModel(config)
        self.lm_head = NormHead(config.hidden_size, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        pass  # fixture_lib re-initialises every parameter

    @torch.no_grad()
    def forward(self, input_ids=None, use_cache=False, norm_head=True, **kwargs):
        """ONE full pass, float64 throughout; logits float64 [B, L, V]."""
        assert not use_cache, "the port has no cache: one full pass only"
        h = self.model.embed_tokens.weight.to(F64)[input_ids]
        for layer in self.model.layers:
            h = layer(h)
        h = self.model.norm(h)
        return CausalLMOutputWithPast(logits=self.lm_head(h, normalize=norm_head))
