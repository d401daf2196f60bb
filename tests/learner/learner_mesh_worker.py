"""Subprocess worker for the mesh tests: one learner step on a fixed batch, results to an .npz.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=N set in the environment (before jax
starts). Multi-process mode joins `jax.distributed` on CPU (gloo collectives); process 0 writes.

  python learner_mesh_worker.py --mesh D,F,T[:K] [--mesh ...] --out DIR
                                [--num-processes 2 --process-id i --port P]
  (:K = use only the first K devices). Writes DIR/mesh_D_F_T.npz per mesh.
  A spec ending in +chunked runs with learner.remat='full' and logits_chunk_tokens=16 (the scan over
  logits chunks on sharded rows and vocab) and writes DIR/mesh_D_F_T_chunked.npz.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", action="append", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()

    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.num_processes, process_id=args.process_id,
                                   initialization_timeout=60)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    for spec in args.mesh:
        spec, chunked = (spec[:-len("+chunked")], True) if spec.endswith("+chunked") else (spec, False)
        shape_s, _, k = spec.partition(":")
        shape = tuple(int(x) for x in shape_s.split(","))
        devices = jax.devices()[: int(k) if k else None]
        mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), ("data", "fsdp", "tensor"))
        out = run_one(mesh, chunked)
        if jax.process_index() == 0:
            np.savez(os.path.join(args.out, "mesh_%d_%d_%d%s.npz" % (*shape, "_chunked" if chunked else "")), **out)
        print("OK", len(devices), shape, float(out["loss"]), flush=True)
    if args.num_processes > 1:
        multihost_utils.sync_global_devices("worker done")


def run_one(mesh, chunked=False):
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from laminar_jax.learner import Learner, LearnerSection
    from laminar_jax.learner.mesh import place
    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.learner.step import make_grad_fn
    from laminar_jax.model import PRESETS, Transformer
    from laminar_jax.types import Trajectory

    section = LearnerSection(lr=1e-3, critic="shared", adv_estimator="gae", lam=0.95, kl_mode="loss", kl_coef=0.05,
                             off_policy="tis", micro_batches=2, loss_agg="seq-mean-token-mean",
                             adam_eps=1e-4)  # eps >> |grad noise|: see test_learner_mesh.py
    if chunked:
        section = dataclasses.replace(section, remat="full", logits_chunk_tokens=16)
    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0), value_head=True)
    learner = Learner(section, model, mesh=mesh)

    rng = np.random.default_rng(0)
    trajs = []
    for i in range(16):
        r = rng.integers(3, 100, int(rng.integers(1, 12)))
        trajs.append(Trajectory(f"p{i // 4}/{i % 4}", f"p{i // 4}", i % 4, np.array([1, 5, 6, 7]), r,
                                rng.normal(-4.8, 0.3, len(r)).astype(np.float32), 0, reward=float(rng.random())))

    batch = learner.collate(trajs)
    assert batch.tokens.shape[0] == 16, batch.tokens.shape
    prepared = learner._prepare(learner.state.params, learner.ref_params, place(batch, learner.batch_shardings))
    grad_fn = jax.jit(make_grad_fn(section, learner.graphs, mesh),
                      in_shardings=(learner.state_shardings.params, learner.batch_shardings))
    grads, metrics = grad_fn(learner.state.params, prepared)
    step_metrics = learner.step(trajs)

    def gather(tree):
        return {k: np.asarray(v) for k, v in multihost_utils.process_allgather(tree, tiled=True).items()}

    out = {"loss": np.asarray(gather({"l": metrics["loss"]})["l"]), "step_loss": np.float32(step_metrics["loss"])}
    out.update({f"grad/{k}": v for k, v in gather(flatten_params(grads["actor"], drop=())).items()})
    out.update({f"param/{k}": v for k, v in gather(flatten_params(learner.state.params["actor"], drop=())).items()})
    out["advantages"] = gather({"a": prepared.advantages})["a"]
    emb = learner.state.params["actor"]["embed_tokens"]["embedding"]
    mu = learner.state.opt_state[-1][0].mu["actor"]["embed_tokens"]["embedding"]  # adamw's ScaleByAdamState
    out["spec_embed"] = np.array(str(tuple(emb.sharding.spec)))
    out["spec_mu_embed"] = np.array(str(tuple(mu.sharding.spec)))
    return out


if __name__ == "__main__":
    main()
