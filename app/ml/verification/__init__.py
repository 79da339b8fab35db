"""Pure verification metrics: retrieval recall, membership statistics (signals), shadows, LiRA / U-LiRA (lira), the
population MIA (mia), the forget-set audit (audit), the verdict policy (policy) and audit plots (plots)."""
