"""The model and its KV memory: config, loader, tokenizer, paged KV cache, runner, scheduler, engine."""
