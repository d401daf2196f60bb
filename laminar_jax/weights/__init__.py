"""The weight plane's wiring: how a trained version becomes what a rollout server serves.

- `plane.WeightsPlane`: the store, the relay chain and the publisher as the Driver sees them;
  `attach(learner)` connects a learner or a learner group.
- `prefetch.Prefetcher`: a server stages the newest version while it drains.
- `host`: a published (flat) version -> an engine's param tree.
- `lora_base`: a LoRA run's base, written once beside the versions, and adapter versions merged into it.
- `export`: a stored version -> a Hugging Face directory.

It sits between the learner, rollout and relay planes, which never import each other.
"""
