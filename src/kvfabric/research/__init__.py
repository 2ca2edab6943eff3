"""kvfabric.research: studies, oracles, baselines and profilers, apart from the runtime.

What lives here is used by `kvfabric bench ...`, `kvfabric profile ...` (and `kvfabric droidspeak profile`, `kvfabric
setup-model` of a fine-tuned sibling) and the research docs: offline optima and the baselines a benchmark compares
against, reference implementations the tests check the kernels with, and the profilers that measure the tables the
runtime ships (cachegen's per-model profile, FlexiCache's head table, DroidSpeak's pair table).

Contract: no runtime module (every kvfabric subpackage but `bench`, `research`, `cli`, `demo`, `demo_rag`) imports
this package; the import-linter contract `runtime-apart-from-research` in pyproject.toml checks it. Where the runtime
must let research code in, it offers a small public hook (a codec's second entropy coder, a head plan, a derived-model
registry, a Blender ranking) and this package plugs into it.

Modules: `belady` (Belady's offline optimum, `kvfabric bench trace`), `cachegen_reference` (cachegen's numpy /
constriction reference coder), `calibrate` (`kvfabric profile cachegen`), `droidspeak_profile` (`kvfabric droidspeak
profile`), `finetune` (the fine-tuned DroidSpeak sibling), `flexicache_baselines` (quest, streaming, h2o and the
shuffled control as FlexiCache head plans), `head_stability` (`kvfabric profile flexicache`, `kvfabric bench flexicache
--study`), `attention_probe` (attention probabilities recorded during a forward: the study and the h2o baseline).
"""
