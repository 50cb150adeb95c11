"""The only code that touches SGLang: flags, startup checks, the attention backend, hooks."""
