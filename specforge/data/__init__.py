"""The data stage: raw files -> clean conversations -> input_ids + loss_mask -> vocab map."""
