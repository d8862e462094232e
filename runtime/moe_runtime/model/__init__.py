"""MoE decoders of several families (Mixtral, Qwen-MoE, OLMoE, DeepSeek, gpt-oss) and their weight sources."""
