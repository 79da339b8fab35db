"""Pure verification metrics (retrieval recall, membership inference, …)."""
