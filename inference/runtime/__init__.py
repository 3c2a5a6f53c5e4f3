"""The core of decoding: the backbone wrapper, the KV cache, trees, verification and the step driver
every decoding method shares."""
