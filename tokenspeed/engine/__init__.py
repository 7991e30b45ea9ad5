"""Engine layer: the engine core loop, the offline LLM API, tokenization and incremental detokenization, outputs.

Import the submodules directly (for example `tokenspeed.engine.tokenizer`); this package imports nothing itself.
"""
