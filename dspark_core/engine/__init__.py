"""Decoding: sampling and lossless verification, the decode loops, acceptance statistics.

One loop per purpose: ``decode_one`` (one request, speculative or plain), ``plain_batch`` (batched plain
decoding for building traces) and ``spec_batch`` (continuous-batched speculative decoding). The protocols
they consume, ``proposer.Proposer`` and ``policy.VerifyPolicy``, live here too, so drafters and schedulers
depend on the engine and never the reverse.
"""
