"""Encrypted cloud backups of a player's gameplay LoRAs: sealed on the device, stored as ciphertext."""
