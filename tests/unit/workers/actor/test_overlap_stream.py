"""The streamed forward pass over slot 0 (dppo.workers.actor.streaming) on the CPU: bitwise equal to a deep copy of
the snapshot, live weights untouched, exception-safe, at most two steps held, and clear about models it
cannot stream."""

from __future__ import annotations

import pytest
import torch

from dppo.models import forward_logits, response_log_probs
from dppo.workers.actor.streaming import NotStreamableError, StreamedWeights, StreamOrderError, trace_schedule

ARCHS = ["qwen2", "llama", "gpt2-tied"]


def _stream(model, pool, ids):
    schedule = trace_schedule(model, lambda: forward_logits(model, ids[:1]))
    return StreamedWeights(pool.streamer(0, schedule.steps), schedule)


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_view_and_swapped_old_log_probs_equal_the_deep_copy_bitwise(
    arch, snapshotted, token_batch, weights_of, assert_same_weights
):
    model, pool, anchor = snapshotted(arch)
    batch = token_batch(rows=5)
    ids, R = batch.input_ids, batch.response_length
    want = response_log_probs(anchor, ids, R, 0.7, 2)  # (5, R), three micro-batches
    live = weights_of(model)
    assert not torch.equal(response_log_probs(model, ids, R, 0.7, 2), want), "live weights must differ from slot 0"

    stream = _stream(model, pool, ids)
    with torch.no_grad():
        streamed = response_log_probs(model, ids, R, 0.7, 2, stream)
        assert_same_weights(model, *live)
        viewed = response_log_probs(model, ids, R, 0.7, 2, pool.view(0))
        assert_same_weights(model, *live)
        with pool.swapped(0):
            swapped = response_log_probs(model, ids, R, 0.7, 2)
        assert_same_weights(model, *live)
    assert torch.equal(streamed, want) and torch.equal(viewed, want) and torch.equal(swapped, want)
    assert stream.passes == 3  # one streamer pass per micro-batch
    assert stream.moved_bytes == 0 and pool.stats()["stream"]["bytes"] == 0  # CPU: the slot is read in place


def test_schedule_follows_the_forward_order_and_streams_a_tied_weight_twice(snapshotted, token_batch):
    model, pool, _ = snapshotted("gpt2-tied")
    ids = token_batch().input_ids
    schedule = trace_schedule(model, lambda: forward_logits(model, ids[:1]))
    assert [b.name for b in schedule.blocks] == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
    steps = schedule.steps
    assert steps[0] == ["transformer.wte.weight"] and steps[-1] == ["lm_head.weight"]
    views = pool.view(0)
    assert views["transformer.wte.weight"].data_ptr() == views["lm_head.weight"].data_ptr()  # one tensor, two steps
    scheduled = [name for step in steps for name in step]
    assert sorted(scheduled) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert all(name in pool.names for name in scheduled)


def test_schedule_of_qwen2_is_embedding_layers_norm_head(snapshotted, token_batch):
    model, _, _ = snapshotted("qwen2")
    schedule = trace_schedule(model, lambda: forward_logits(model, token_batch().input_ids[:1]))
    assert [b.name for b in schedule.blocks] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    assert len(schedule.steps[1]) == len(list(model.model.layers[0].parameters()))


def _hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


@pytest.mark.parametrize("arch", ["qwen2", "gpt2-tied"])
def test_an_exception_inside_a_block_leaves_the_model_with_its_own_parameters(
    arch, snapshotted, token_batch, weights_of, assert_same_weights
):
    model, pool, anchor = snapshotted(arch)
    ids = token_batch().input_ids
    stream = _stream(model, pool, ids)
    live, hooks = weights_of(model), _hook_counts(model)
    inner = (model.model.layers[1] if arch == "qwen2" else model.transformer.h[1]).mlp

    def boom(module, args):
        raise RuntimeError("injected failure inside a streamed block")

    handle = inner.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="injected failure"), torch.no_grad():
        forward_logits(model, ids, stream)
    handle.remove()
    assert_same_weights(model, *live)
    assert _hook_counts(model) == hooks  # the streaming hooks are gone too
    with torch.no_grad():  # and the streamer is ready for the next pass
        assert torch.equal(forward_logits(model, ids, stream), forward_logits(anchor, ids))


class _RecordingStreamer:
    """Wraps a Streamer and records how many acquired steps are held (not yet released) at any time."""

    def __init__(self, inner):
        self.inner, self.held, self.max_held, self.events = inner, set(), 0, []

    def begin(self):
        self.inner.begin()

    def end(self):
        self.inner.end()

    def acquire(self, step):
        out = self.inner.acquire(step)
        self.held.add(step)
        self.max_held = max(self.max_held, len(self.held))
        self.events.append(("acquire", step))
        return out

    def release(self, step):
        self.inner.release(step)
        self.held.discard(step)
        self.events.append(("release", step))

    @property
    def mode(self):
        return self.inner.mode


def test_a_pass_holds_at_most_two_steps_and_walks_them_in_order(snapshotted, token_batch):
    model, pool, _ = snapshotted("llama")
    ids = token_batch().input_ids
    schedule = trace_schedule(model, lambda: forward_logits(model, ids[:1]))
    streamer = pool.streamer(0, schedule.steps)
    assert streamer.mode == "host" and streamer.staging_bytes == 0  # CPU: no staging buffers at all
    recorder = _RecordingStreamer(streamer)
    with torch.no_grad():
        forward_logits(model, ids, StreamedWeights(recorder, schedule))
    n = len(schedule.steps)
    assert recorder.events == [(op, i) for i in range(n) for op in ("acquire", "release")]
    assert recorder.max_held <= 2  # the engine's staged mode has two buffers; a pass never needs a third


class _TwoLayers(torch.nn.Module):
    """Embedding, two layers (the second skippable or repeatable), head: a forward order that can vary."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 11)
        self.plan = [0, 1]

    def forward(self, input_ids, use_cache=False):
        h = self.embed(input_ids)
        for i in self.plan:
            h = torch.tanh(self.layers[i](h))
        return type("Out", (), {"logits": self.head(h)})()


def test_a_block_the_pass_skips_is_stepped_over_and_an_extra_call_is_an_order_error(weights_of, assert_same_weights):
    import copy

    from dppo.snapshot import SnapshotPool

    torch.manual_seed(0)
    model = _TwoLayers()
    pool = SnapshotPool(model)
    pool.save(0)
    pool.fence()
    anchor = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    ids = torch.randint(0, 11, (3, 5))
    stream = _stream(model, pool, ids)
    model.plan = anchor.plan = [0]  # this pass skips layer 1
    with torch.no_grad():
        assert torch.equal(forward_logits(model, ids, stream), forward_logits(anchor, ids))
    live = weights_of(model)
    model.plan = [0, 1, 1]  # layer 1 twice: the traced schedule has one step for it
    with pytest.raises(StreamOrderError, match=r"block 'layers.1' ran again"), torch.no_grad():
        forward_logits(model, ids, stream)
    assert_same_weights(model, *live)


class _UsesChildWeightDirectly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, input_ids, use_cache=False):
        h = self.embed(input_ids)
        return type("Out", (), {"logits": self.head(h) + h @ self.embed.weight.T})()  # a tied read by the parent


class _Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.embed = torch.nn.Embedding(11, 8)

    def forward(self, input_ids, use_cache=False):
        return type("Out", (), {"logits": self.embed(input_ids) * self.scale})()


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Nested()
        self.bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, input_ids, use_cache=False):
        return self.inner(input_ids)


@pytest.mark.parametrize("model_cls, message", [
    (_UsesChildWeightDirectly, r"'embed.weight' is used by .* outside every block"),
    (_Outer, r"blocks nest: block 'inner' runs inside block '\(root\)'"),
])  # fmt: skip
def test_models_whose_parameters_are_read_outside_their_block_are_not_streamable(model_cls, message):
    model = model_cls()
    ids = torch.randint(0, 11, (2, 4))
    with pytest.raises(NotStreamableError, match=message):
        trace_schedule(model, lambda: forward_logits(model, ids))
    assert isinstance(NotStreamableError("x"), ValueError)


def test_a_blocks_own_hooks_see_the_slot_weights(snapshotted, token_batch):
    model, pool, _ = snapshotted("qwen2")
    ids = token_batch().input_ids
    stream = _stream(model, pool, ids)
    layer = model.model.layers[0]
    seen = []
    handles = [
        layer.register_forward_pre_hook(lambda m, a: seen.append(m.self_attn.q_proj.weight.data_ptr())),
        layer.register_forward_hook(lambda m, a, o: seen.append(m.self_attn.q_proj.weight.data_ptr())),
    ]
    with torch.no_grad():
        forward_logits(model, ids, stream)
    for handle in handles:
        handle.remove()
    slot_ptr = pool.view(0)["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    assert seen == [slot_ptr, slot_ptr]
    assert layer.self_attn.q_proj.weight.data_ptr() != slot_ptr  # and the live Parameter is back afterwards
