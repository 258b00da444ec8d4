"""Speculative decoding: proposers of draft tokens and the verification of drafts against the target model.

``config.py`` parses vLLM's ``speculative_config``; ``ngram.py`` proposes drafts by prompt lookup;
``eligibility.py`` says which sequences may be drafted for; ``verify.py`` accepts drafts on the device
(greedy: the longest matching prefix; sampled: rejection sampling); ``stats.py`` counts acceptance.
The scheduler gives a drafted sequence 1 + k rows in a step and rolls back rejected slots.
"""
