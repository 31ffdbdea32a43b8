"""Graph analysis and rewrites on Dynamo FX graphs: site discovery, factorization, rewriting."""
