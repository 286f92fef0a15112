"""Studies: populations of models → sharpness → correlation with generalization (SPEC §2, §7)."""
