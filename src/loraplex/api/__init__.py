"""HTTP surface: the Tinker wire protocol, codecs, auth. Translates wire <-> runtime commands. No tensors."""
