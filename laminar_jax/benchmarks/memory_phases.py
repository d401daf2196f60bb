"""The measured phases of `bench.py memory`, shared by the scaled run on fake CPU devices (memory.py)
and the real-size run on accelerators (memory_device.py): a learner's steps, a server's generate,
swap and repack, and how live and program bytes are read off the devices.
"""

from __future__ import annotations

import os
import sys


def live_bytes(devices) -> dict[int, int]:
    """Bytes of every live jax array's shards, per device index, each buffer once (a shard's
    ``data`` is itself a live array over the same buffer, so arrays are told apart by address)."""
    import jax

    index = {d: i for i, d in enumerate(devices)}
    out = {i: 0 for i in index.values()}
    seen = set()
    for a in jax.live_arrays():
        for s in a.addressable_shards:
            key = (index[s.device], s.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[key[0]] += s.data.nbytes
    return out


def program_extra(compiled) -> int:
    """A compiled program's peak beyond its arguments, per device: temporaries + unaliased outputs."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def unsharded(devices, arch, sharded_on: set[int]) -> int:
    """Buffers holding a whole weight matrix of the model (its full shape) on a device whose role
    keeps that matrix sharded (learner devices under FSDP > 1, servers at TP > 1)."""
    import jax

    from laminar_jax.placement_memory import param_table

    index = {d: i for i, d in enumerate(devices)}
    # a matrix of one layer, or a stack of them (the layers' scan: a leading unnamed layer axis);
    # a stack of vectors (norms, biases) is not one
    stacked = lambda shape, axes: len(shape) > 1 and shape[0] == arch.num_layers and axes[0] is None
    matrices = [(shape, stacked(shape, axes)) for shape, axes in param_table(arch)]
    # the stack itself, and one layer's matrix out of it (a gathered or staged layer)
    whole = {shape for shape, s in matrices if len(shape) - s == 2} | \
        {shape[1:] for shape, s in matrices if s and len(shape) == 3}
    arrays = jax.live_arrays()
    # A shard's `data` is a single-device live array over a multi-device array's own buffer: a view,
    # not a copy (a TP-split vocab table's [vocab / tp, hidden] shard may have a weight matrix's shape);
    # a whole matrix replicated over the devices still counts, through the multi-device array.
    views = {s.data.unsafe_buffer_pointer() for a in arrays if len(a.sharding.device_set) > 1
             for s in a.addressable_shards}
    seen = set()
    for a in arrays:
        if a.shape not in whole:
            continue
        for s in a.addressable_shards:
            ptr = s.data.unsafe_buffer_pointer()
            view = len(a.sharding.device_set) == 1 and ptr in views
            if index[s.device] in sharded_on and s.data.shape == a.shape and not view:
                seen.add((index[s.device], ptr))
                if os.environ.get("LAMINAR_BENCH_PHASES"):
                    print(f"unsharded: {a.shape} {a.dtype} {a.sharding} on device {index[s.device]}", file=sys.stderr)
    return len(seen)


def learner_phases(cfg, arch, layout, devices, sample, steps: int = 2):
    """A `Learner` on the layout's learner devices (the model loaded straight onto its shards, as a
    run loads it) takes ``steps`` GRPO steps on worst-case trajectories (every one at
    rollout.max_total_len), ``sample`` called at each phase (None: no sampling, nothing compiled
    apart from the step itself); returns the learner."""
    from laminar_jax.benchmarks.learner import synthetic_trajectories
    from laminar_jax.learner import Learner
    from laminar_jax.learner.mesh import build_mesh

    mesh = build_mesh(cfg.mesh, [devices[i] for i in layout.learner])
    model = learner_model(cfg, arch, mesh)
    learner = Learner(cfg.learner, model, mesh, rules=cfg.mesh.rules, publish_dtype=getattr(cfg.rollout, "dtype", None))
    del model  # the learner holds its own sharded copy
    seq = cfg.rollout.max_total_len
    trajs = synthetic_trajectories(cfg.runtime.prompts_per_step * cfg.runtime.samples_per_prompt, seq,
                                   arch.vocab_size, cfg.runtime.samples_per_prompt, 0)
    on = lambda b: {d: b for d in layout.learner}  # noqa: E731 - an SPMD program's figure is per device
    for _ in range(steps):
        if sample is not None:  # each program's own peak, compiled for its figure
            prepared = learner.prepare(trajs, learner.version)
            sample(on(program_extra(learner._prepare.lower(learner.state.params, learner.ref_params,
                                                           prepared.batch).compile())), "prepare")
            prep = learner._prepare(learner.state.params, learner.ref_params, prepared.batch)
            step = learner._train_step.lower(learner.state, prep).compile()
            sample(on(program_extra(step)), "update")
            del prep
        learner.step(trajs, publish=False)
        if sample is not None:
            sample(label="stepped")
    return learner


def learner_model(cfg, arch, mesh):
    """The policy on the learner's mesh: the config's own model loaded straight onto its shards (as
    a run loads it: model.sharded.load_model), or, for a scaled architecture the config cannot name,
    a tiny float32 model built on the default device (the learner places its own sharded copy)."""
    import numpy as np
    from flax import nnx

    from laminar_jax.learner.mesh import sharding_of
    from laminar_jax.model.sharded import abstract_model, load_model
    from laminar_jax.model.transformer import Transformer
    from laminar_jax.placement_memory import arch_of

    if arch == arch_of(cfg):
        return load_model(cfg.model, sharding_of(abstract_model(cfg.model), mesh, cfg.mesh.rules))
    return Transformer(arch, rngs=nnx.Rngs(0), param_dtype=np.float32)


def serve_and_swap(cfg, arch, server_devices, flat, sample, sharded_on, devices) -> int:
    """One server on its devices: generate, swap in a new version, generate, move a sequence out and in.
    ``sample`` None: no sampling and no program compiled for its figure (the allocator's peak measures)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from laminar_jax.model.sharded import abstract_model
    from laminar_jax.placement_memory import arch_of
    from laminar_jax.rollout.engine import Engine, make_engine
    from laminar_jax.rollout.records import Request
    from laminar_jax.rollout.server import RolloutServer
    from laminar_jax.runtime.fleet import params_from_flat, server_mesh, server_section

    measure = sample is not None
    sample = sample or (lambda *a, **k: None)
    section = server_section(cfg, 0, 0)
    mesh = server_mesh(server_devices)
    if arch == arch_of(cfg):  # the config's own model, as a run's fleet builds its servers (fleet.py)
        abstract = abstract_model(cfg.model)
        engine, _ = make_engine(abstract, section, mesh=mesh)
    else:
        abstract = nnx.eval_shape(lambda: Transformer_(arch))
        engine = Engine(nnx.split(abstract)[0], arch, section, kv_dtype=jnp.float32, mesh=mesh)
    from_flat = params_from_flat(abstract, engine, getattr(cfg.rollout, "dtype", None))
    server = RolloutServer(engine, from_flat(flat), version=0)
    on = lambda b: {i: b for i, d in enumerate(devices) if d in server_devices}  # noqa: E731
    rng = np.random.default_rng(0)
    for k in range(section.num_slots):
        server.submit(Request(uid=f"p{k}/0", prompt_ids=rng.integers(3, arch.vocab_size, 24).astype(np.int32),
                              prompt_uid=f"p{k}", sample_index=0, seed=k))
    for _ in range(3):
        server.step()
        sample(on(generate_extra(engine, server)) if measure else None, "generate")
    new = from_flat({k: (v * np.float32(1.001)).astype(v.dtype) for k, v in flat.items()})
    if hasattr(new, "on_leaf"):  # a version streamed into place at the swap: sample after every tensor placed
        new = new._replace(on_leaf=lambda i, placed: sample(label="swap"))
    server.set_params(1, new, force=True)  # as RolloutWorker._maybe_swap, forced: no waiting for drains
    del new
    sample(label="swap")
    server.step()
    sample()
    for k in range(2):
        server.submit(Request(uid=f"q{k}/0", prompt_ids=rng.integers(3, arch.vocab_size, 24).astype(np.int32),
                              prompt_uid=f"q{k}", sample_index=0, seed=100 + k))
    for _ in range(2):
        server.step()
        sample(on(generate_extra(engine, server)) if measure else None, "generate")
    live = server.live_slots()
    if live:  # a repack move's two halves on one server: export a live sequence, import it again
        slot = next(iter(live))
        seq = server.export_sequence(slot)
        sample()
        server.import_sequence(seq)
        server.step()
        sample()
    jax.block_until_ready(server._state)
    return unsharded(devices, arch, {i for i, d in enumerate(devices) if d in server_devices and sharded_on})


def Transformer_(arch):
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.model.transformer import Transformer

    return Transformer(arch, rngs=nnx.Rngs(0), param_dtype=jnp.float32)


def generate_extra(engine, server) -> int:
    """The generate program's own peak for the server's current call shape."""
    bound = engine.bound(server._params)
    rows, chunks = engine.page_book.rows()
    bucket = engine.page_book.live_bucket()
    return program_extra(bound.generate_program(len(rows)).lower(bound.leaves, server._state, rows, chunks, bucket)
                         .compile())
