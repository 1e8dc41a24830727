"""Choosing the next tokens: the sampler, grammars (structured output), speculative decoding's
windows and the MTP drafter."""
