"""How much to verify: verify policies, the drafting gate, step-rate profiles and the live cost model."""
