"""How weights are stored: int4 codes, extents, safetensors and MLX files."""
