"""DiffusionGemma (`diffusion_gemma`, transformers' DiffusionGemmaForBlockDiffusion).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, S, head_dim] (per-rank counts under TP), head_dim and KV heads the
layer's own (full layers: `per_layer_config`, or the published
`global_head_dim` / `num_global_key_value_heads`). Canvas [B, C] ids; canvas
logits [B, C, V] float32.

One Gemma 4 MoE backbone, two uses of it:
- the ENCODER is a causal LM over the prompt: Gemma 4 layers (q/k norms,
  weightless v norm, scale 1, v = raw k on full layers, proportional RoPE on
  full layers, dense MLP beside routed experts) each ending with the
  encoder's own `layer_scalar`; its KV cache holds the prompt. `__call__`
  returns its logits (final norm, tied head, softcap 30): what every feeding
  mode of the harness checks.
- the DECODER (`canvas_logits`) denoises a canvas of C tokens placed right
  after the prompt (positions P..P+C-1): the same weights (transformers ties
  every encoder weight to the decoder's, only `layer_scalar` differs), the
  canvas embeddings passed through the self-conditioning block (soft
  embeddings from the previous step's logits), attention over the cached
  prompt keys (all of them on full layers, the last window-1 on sliding
  layers, as transformers' DynamicCache keeps) plus the canvas, every key
  visible (bidirectional), the cache left untouched (cache.PrefixViewCache).
- `generate_ids` / `block_diffusion` run transformers' block-diffusion loop
  (DiffusionGemmaGenerationMixin.generate): canvas after canvas, each denoised
  up to max_denoising_steps times with the linear temperature schedule, the
  entropy-bound sampler (accept, renoise) and the stable-and-confident stop,
  then encoded into the prompt cache.

Tensor parallelism: as gemma4 (heads, dense MLP and experts split, one
all_sum each); the self-conditioning block is replicated. The head's logits
are all_gathered to every rank (CausalLM.head), so the self-conditioning
softmax is over the whole vocabulary on every rank; the embedding matrix is
whole on every rank (the soft embeddings read every row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..nn.blocks import MLP, Gemma4Attention, Gemma4Block, Gemma4Experts, Gemma4Router, gemma4_expert_name, \
    gemma4_rope, gemma4_rope_params
from ..cache import PrefixViewCache, make_layer_caches
from ..errors import UserError
from ..nn.layers import RMSNormFP32Scale, activation, gated_fp32
from ..parallel.shard import shard_attention, shard_mlp, shard_switch_glu
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types

_DROP = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
_ENCODER = "model.encoder.language_model."

# transformers' DiffusionGemmaGenerationConfig._get_default_generation_params
GENERATION_DEFAULTS = dict(max_denoising_steps=48, entropy_bound=0.1, t_min=0.4, t_max=0.8,
                           stability_threshold=1, confidence_threshold=0.005)  # fmt: skip


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "diffusion_gemma"
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = 30.0
    use_bidirectional_attention: str | None = None
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict | None = None
    canvas_length: int = 256
    eos_token_id: int | list | None = 1
    pad_token_id: int | None = 0
    generation: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, params: dict):
        # The text model sits under text_config; canvas_length and the tie are top-level keys.
        text = params.get("text_config")
        if not isinstance(text, dict):
            raise UserError("diffusion_gemma config.json needs a text_config object")
        text = dict(text)
        text["tie_word_embeddings"] = params.get("tie_word_embeddings", True)
        if params.get("canvas_length") is not None:
            text["canvas_length"] = params["canvas_length"]
        return super().from_dict(text)

    def __post_init__(self):
        if not self.tie_word_embeddings:
            # transformers: False undoes every tie, encoder and decoder then have separate weights
            raise UserError("diffusion_gemma with tie_word_embeddings false (untied encoder/decoder) is not supported")
        if self.use_bidirectional_attention == "all":
            raise UserError("diffusion_gemma with use_bidirectional_attention 'all' (a bidirectional encoder) "
                            "is not supported")  # fmt: skip
        if not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise UserError("diffusion_gemma needs num_experts, top_k_experts and moe_intermediate_size")
        if not 1 <= self.top_k_experts <= self.num_experts:
            raise UserError(f"diffusion_gemma top_k_experts {self.top_k_experts} must be in 1..{self.num_experts}")
        if not self.canvas_length or self.canvas_length < 1:
            raise UserError(f"diffusion_gemma canvas_length must be >= 1, got {self.canvas_length}")
        if self.layer_types is None:
            types = derive_layer_types(None, self.num_hidden_layers, self.sliding_window, 6)
        else:
            types = derive_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        types[-1] = FULL  # transformers forces the last layer to full attention
        self.layer_types = types
        self.layer_heads = self._layer_heads()
        self.rope = gemma4_rope_params(self.rope_parameters, self.layer_types, "diffusion_gemma")
        eos = self.eos_token_id
        self.eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def _layer_heads(self) -> list:
        if self.per_layer_config is not None:
            over = {}
            for key, val in self.per_layer_config.items():
                try:
                    i = int(key)
                except (TypeError, ValueError):
                    raise UserError(f"diffusion_gemma per_layer_config key {key!r} is not a layer index") from None
                bad = sorted(set(val) - {"head_dim", "num_key_value_heads"})
                if bad or not 0 <= i < self.num_hidden_layers:
                    raise UserError(f"diffusion_gemma per_layer_config[{key}] overrides {bad or 'a missing layer'}")
                over[i] = val
        else:
            # transformers' __post_init__: full layers get global_head_dim and, when given, the global KV heads
            full = {"head_dim": self.global_head_dim}
            if self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            over = {i: full for i, t in enumerate(self.layer_types) if t == FULL}
        heads = [
            (int(over.get(i, {}).get("head_dim", self.head_dim)),
             int(over.get(i, {}).get("num_key_value_heads", self.num_key_value_heads)))
            for i in range(self.num_hidden_layers)
        ]  # fmt: skip
        for kind in set(self.layer_types):
            if len({h for h, t in zip(heads, self.layer_types) if t == kind}) > 1:
                raise UserError(f"diffusion_gemma gives {kind} layers different head shapes: unsupported")
        return heads


class DecoderLayer(Gemma4Block):
    """A Gemma 4 MoE layer (weights shared by encoder and decoder); the caller
    gives the layer scalar of the pass (encoder's or decoder's)."""

    def __init__(self, args: ModelArgs, i: int):
        kind = args.layer_types[i]
        head_dim, kv_heads = args.layer_heads[i]
        eps, H = args.rms_norm_eps, args.hidden_size
        attn = Gemma4Attention(
            H, args.num_attention_heads, kv_heads, head_dim,
            window=args.sliding_window if kind == SLIDING else None,
            rope=gemma4_rope(args.rope[kind], head_dim), eps=eps, bias=args.attention_bias,
            k_eq_v=kind == FULL,  # transformers builds v_proj on sliding layers only
        )  # fmt: skip
        act = activation(args.hidden_activation)
        moe = (Gemma4Router(H, args.num_experts, args.top_k_experts, eps),
               Gemma4Experts(args.num_experts, H, args.moe_intermediate_size, act))
        super().__init__(attn, MLP(H, args.intermediate_size, act), H, lambda d: RMSNormFP32Scale(d, eps), moe)


class SelfConditioning(nn.Module):
    """post_norm(inputs + down(act(gate(n)) * up(n))), n = pre_norm(soft
    embeddings); post_norm has no weight."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, I, eps = args.hidden_size, args.intermediate_size, args.rms_norm_eps
        self.pre_norm = RMSNormFP32Scale(H, eps)
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act, self.eps = activation(args.hidden_activation), eps

    def __call__(self, inputs, soft):
        n = self.pre_norm(soft)
        s = self.down_proj(gated_fp32(self.act)(self.gate_proj(n), self.up_proj(n)))
        return mx.fast.rms_norm(inputs + s, None, self.eps)


class DiffusionDecoder(DecoderStack):
    """`model.decoder`: the shared embeddings, layers and final norm, plus the
    self-conditioning block."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNormFP32Scale(args.hidden_size, args.rms_norm_eps)
        self.self_conditioning = SelfConditioning(args)

    def embed(self, inputs):
        h = self.embed_tokens(inputs)
        # sqrt(hidden) as an fp32 buffer cast to the weights' dtype (as the reference)
        return h * mx.array(self.args.hidden_size**0.5, mx.float32).astype(h.dtype)


class EncoderScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = mx.ones((1,))


class EncoderText(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = [EncoderScalar() for _ in range(n)]


class Encoder(nn.Module):
    """`model.encoder`: of its own only the per-layer scalars (every other
    encoder weight is tied to the decoder's)."""

    def __init__(self, n: int):
        super().__init__()
        self.language_model = EncoderText(n)


class DiffusionGemmaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.encoder = Encoder(args.num_hidden_layers)
        self.decoder = DiffusionDecoder(args)
        self.stage = None  # the model contract's (CausalLM.stage): it never runs in pipeline stages

    @property
    def layers(self):
        return self.decoder.layers

    @property
    def embed_tokens(self):
        return self.decoder.embed_tokens

    def masks(self, L: int, cache) -> dict:
        return self.decoder.masks(L, cache)

    def __call__(self, inputs, cache=None):
        """The encoder: causal over the prompt, writing its KV into `cache`."""
        dec = self.decoder
        h = dec.embed(inputs)
        masks = self.masks(inputs.shape[1], cache)
        cache = cache if cache is not None else [None] * len(dec.layers)
        for layer, enc, kind, c in zip(dec.layers, self.encoder.language_model.layers, self.args.layer_types, cache):
            h = layer(h, masks[kind], c, enc.layer_scalar)
        return dec.norm(h)

    def soft_embeddings(self, logits):
        """softmax(logits) [B, C, V] (fp32, then the embeddings' dtype) times
        the embedding matrix, times sqrt(hidden)."""
        emb = self.decoder.embed_tokens
        dt = emb.scales.dtype if "scales" in emb else emb.weight.dtype
        p = mx.softmax(logits.astype(mx.float32), axis=-1).astype(dt)
        if "scales" in emb:  # quantized: p @ W without unpacking W ([V, hidden] stored as rows)
            out = mx.quantized_matmul(p, emb.weight, emb.scales, emb.get("biases"), transpose=False,
                                      group_size=emb.group_size, bits=emb.bits, mode=getattr(emb, "mode", "affine"))
        else:
            out = p @ emb.weight
        return out * mx.array(self.args.hidden_size**0.5, mx.float32).astype(out.dtype)

    def decode_canvas(self, canvas, cache, sc_logits=None):
        """Final hidden states [B, C, hidden] of the canvas after the prompt
        held by `cache` (read, never written)."""
        a, dec = self.args, self.decoder
        x = dec.embed(canvas)
        soft = mx.zeros_like(x) if sc_logits is None else self.soft_embeddings(sc_logits).astype(x.dtype)
        h = dec.self_conditioning(x, soft)
        views = [PrefixViewCache(c, a.sliding_window - 1 if kind == SLIDING else None)
                 for c, kind in zip(cache, a.layer_types)]  # fmt: skip
        C = canvas.shape[1]
        masks = {}
        for kind, v in zip(a.layer_types, views):
            masks.setdefault(kind, v.mask(C))
        for layer, kind, v in zip(dec.layers, a.layer_types, views):
            h = layer(h, masks[kind], v)
        return dec.norm(h)


def _softcap(logits, cap):
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits


def _f32(x) -> np.float32:
    return np.float32(x)


def _temperature(t_min: float, t_max: float, step: int, steps: int) -> np.float32:
    # As transformers computes it: cur_step an int32 tensor, so every step is in float32.
    frac = _f32(step) / _f32(steps)
    return _f32(_f32(t_min) + _f32(_f32(t_max - t_min) * frac))


def _entropy(logits):
    """torch.distributions.Categorical(logits=logits).entropy(), float32."""
    lg = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.softmax(logits, axis=-1)
    return -(lg * p).sum(axis=-1)


class Model(CausalLM):
    own_loop = True  # generate_ids is its generation loop (block diffusion), not token-by-token decode

    def __init__(self, args: ModelArgs):
        super().__init__(args, DiffusionGemmaModel(args))

    @property
    def head_layer(self) -> nn.Module:
        return self.model.decoder.embed_tokens

    def __call__(self, inputs, cache=None):
        """The encoder's causal LM logits [B, L, V]."""
        return _softcap(self.head(self.model(inputs, cache)), self.args.final_logit_softcapping)

    def canvas_logits(self, canvas, cache, sc_logits=None):
        """The decoder's logits [B, C, V] (float32, softcapped) for a canvas
        after the prompt in `cache`, self-conditioned on `sc_logits` (the
        previous step's processed logits [B, C, V]) or on nothing (None)."""
        h = self.model.decode_canvas(canvas, cache, sc_logits)
        return _softcap(self.head(h).astype(mx.float32), self.args.final_logit_softcapping)

    def make_cache(self):
        return make_layer_caches(self.args.layer_types, self.args.sliding_window)

    def block_diffusion(self, prompt_ids, max_new_tokens: int, *, max_denoising_steps=None, entropy_bound=None,
                        t_min=None, t_max=None, stability_threshold=None, confidence_threshold=None,
                        eos_ids=None, pad_id=None, noise=None, sample=None, prefill_step: int = 2048):
        """transformers' DiffusionGemmaGenerationMixin.generate (batch 1):
        returns the generated ids (every canvas whole, after the last EOS
        padded with `pad_id`, as transformers' `sequences` past the prompt)
        and the number of decoder passes.

        `noise(C)` -> C token ids: the sampler's random canvas (the first
        canvas and the renoising draws, in transformers' order); `sample(probs
        [C, V] mx) -> ids [C]`: the denoiser's draw from the tempered
        distribution (None: argmax, the greedy variant)."""
        g = {**GENERATION_DEFAULTS, **self.args.generation}
        for k, v in dict(max_denoising_steps=max_denoising_steps, entropy_bound=entropy_bound, t_min=t_min,
                         t_max=t_max, stability_threshold=stability_threshold,
                         confidence_threshold=confidence_threshold).items():  # fmt: skip
            if v is not None:
                g[k] = v
        a = self.args
        C, N = a.canvas_length, int(g["max_denoising_steps"])
        eos = set(a.eos_ids if eos_ids is None else eos_ids)
        pad = a.pad_token_id if pad_id is None else pad_id
        if noise is None:
            raise ValueError("block_diffusion needs a noise source")
        prompt = [int(t) for t in prompt_ids]
        cache = self.make_cache()
        for i in range(0, len(prompt), prefill_step):
            self.model(mx.array(prompt[i : i + prefill_step])[None], cache)
            mx.eval([c.state for c in cache])
        out, passes = [], 0
        for _ in range(math.ceil(max_new_tokens / C)):
            canvas = mx.array(np.asarray(noise(C), np.int32))[None]
            sc, argmax = None, canvas
            history = np.full((int(g["stability_threshold"]), C), -1, np.int64)
            for step in range(N, 0, -1):
                passes += 1
                logits = self.canvas_logits(canvas, cache, sc)
                temp = _temperature(g["t_min"], g["t_max"], step, N)
                processed = logits / mx.array(temp, mx.float32)
                if sample is None:
                    drawn = mx.argmax(processed, axis=-1).astype(mx.int32)
                else:
                    drawn = sample(mx.softmax(processed[0], axis=-1)).reshape(1, C).astype(mx.int32)
                new_argmax = mx.argmax(processed, axis=-1).astype(mx.int32)
                ent = _entropy(processed)  # [1, C]
                ent_np = np.array(ent[0])
                order = np.argsort(ent_np, kind="stable")
                srt = ent_np[order]
                sel = (np.cumsum(srt, dtype=np.float32) - srt) <= _f32(g["entropy_bound"])
                accepted_mask = np.zeros(C, bool)
                accepted_mask[order] = sel
                accept = mx.array(accepted_mask)[None]
                accepted = mx.where(accept, drawn, canvas)
                fresh = mx.array(np.asarray(noise(C), np.int32))[None]
                canvas = mx.where(accept, accepted, fresh)
                am = np.array(new_argmax[0]).astype(np.int64)
                if history.shape[0] == 0:
                    stable = True
                else:
                    stable = bool((history == am[None]).all())
                    history = np.roll(history, -1, axis=0)
                    history[-1] = am
                confident = float(ent_np.mean(dtype=np.float32)) < g["confidence_threshold"]
                sc, argmax = processed, new_argmax
                if stable and confident:
                    break
            block = [int(t) for t in np.array(argmax[0])]
            hit = [i for i, t in enumerate(block) if t in eos]
            if hit or len(prompt) + len(out) + C >= len(prompt) + max_new_tokens:
                if hit and pad is not None:
                    block = block[: hit[0] + 1] + [pad] * (C - hit[0] - 1)
                out += block
                break
            out += block
            self.model(mx.array(block)[None], cache)  # the accepted canvas joins the prompt
            mx.eval([c.state for c in cache])
        return out, passes

    def generate_ids(self, prompt_ids, max_tokens: int, sampling=None, eos_ids=(), group=None):
        """The engine's generation hook (generation.generate_text uses it when a
        model has one): ids from `block_diffusion`, up to EOS (not yielded)
        and at most `max_tokens`. Temperature 0 (the CLI's default): the
        greedy variant (argmax denoiser draws); otherwise the denoiser
        samples. The noise and draws come from mx.random keyed by the seed, the
        same on every rank."""
        seed = getattr(sampling, "seed", None) or 0
        key = [mx.random.key(seed)]

        def split():
            key[0], sub = mx.random.split(key[0])
            return sub

        def noise(C):
            return np.array(mx.random.randint(0, self.args.vocab_size, (C,), key=split()))

        sample = None
        if sampling is not None and getattr(sampling, "temp", 0.0) > 0:
            def sample(probs):
                return mx.random.categorical(mx.log(probs), key=split())

        ids, _ = self.block_diffusion(prompt_ids, max_tokens, eos_ids=list(eos_ids) or None, noise=noise,
                                      sample=sample)
        eos = set(eos_ids) or set(self.args.eos_ids)
        for t in ids[:max_tokens]:
            if t in eos:
                return
            yield t

    def describe_layers(self) -> list[str]:
        a = self.args
        out = []
        for i, (kind, layer) in enumerate(zip(a.layer_types, self.layers)):
            attn = layer.self_attn
            what = f"sliding (window {attn.window})" if kind == SLIDING else "full"
            parts = [what, f"head_dim {attn.head_dim}, {attn.total_num_kv_heads} KV heads", attn.rope.describe()]
            if attn.k_eq_v:
                parts.append("k = v")
            parts.append(f"MoE {a.num_experts} experts top-{a.top_k_experts} + dense MLP")
            parts.append("encoder causal / canvas decoder bidirectional, own layer scalars")
            out.append(f"{i}: " + ", ".join(parts))
        return out

    def sanitize(self, weights: dict) -> dict:
        """Drop the vision tower and its embedder, and any stored copy of an
        encoder weight tied to the decoder (all but the encoder's
        layer_scalar) or of the tied head."""
        out = {}
        for name, w in weights.items():
            if name.startswith(_DROP):
                continue
            if name.startswith(_ENCODER) and not name.endswith(".layer_scalar"):
                continue
            out[gemma4_expert_name(name)] = w
        return super().sanitize(out)

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            shard_mlp(layer.mlp, group)
            shard_switch_glu(layer.experts, group)
            if not group.single:
                layer.experts.group = group
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum per sharded MoE block ([1, hidden])."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            ex = layer.experts
            if not ex.group.single:
                calls += 1
                d = ex.down_proj
                nbytes += d.weight.shape[1] * (d.scales if "scales" in d else d.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
