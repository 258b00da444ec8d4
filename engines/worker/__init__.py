"""What runs a step on one device: the model runner, the step's input tensors, the sampler, decode buckets and graphs, warm-up and CPU threads."""
