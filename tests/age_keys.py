"""A throwaway SSH ed25519 key pair for the tests of encrypted exports (age encrypts to SSH keys too), kept
here so that no test needs ssh-keygen. It protects nothing."""

SSH_PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILHpChi+0RjMyBkAPXW97nxrva/akR90G4FYgCtqJi6t"
SSH_PRIVATE_KEY = b"""-----BEGIN OPENSSH PRIVATE KEY-----
b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW
QyNTUxOQAAACCx6QoYvtEYzMgZAD11ve58a72v2pEfdBuBWIAraiYurQAAAIgwc6QbMHOk
GwAAAAtzc2gtZWQyNTUxOQAAACCx6QoYvtEYzMgZAD11ve58a72v2pEfdBuBWIAraiYurQ
AAAEDDdXb3w3Qnp2W8Z1CznmKwZUtT26OnnRxVIwsl3QneybHpChi+0RjMyBkAPXW97nxr
va/akR90G4FYgCtqJi6tAAAAAAECAwQF
-----END OPENSSH PRIVATE KEY-----
"""
