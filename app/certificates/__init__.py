"""Signed deletion certificates: DSSE envelopes over in-toto Statements, Ed25519 keys, offline verification."""
