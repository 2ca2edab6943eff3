"""DroidSpeak: a model reuses a sibling's KV cache (same family, tokenizer and layout), recomputing only a profiled
contiguous block of layers from the sibling's hidden state.

* :mod:`kvfabric.droidspeak.family` - family members, the shared key namespace, the KV + hidden-state chunk store.
* :mod:`kvfabric.droidspeak.runtime` - sender prefill with hidden states, the receiver's block recompute.
* :mod:`kvfabric.droidspeak.table` - a pair's profile table: the block the receiver recomputes.
* :mod:`kvfabric.droidspeak.pair` - loading a sender/receiver pair, its prompts.

The profiler that measures a pair's table is kvfabric.research.droidspeak_profile (`kvfabric droidspeak profile`).
"""
