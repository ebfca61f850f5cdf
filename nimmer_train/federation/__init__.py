"""Federated rounds: the Flower app's library (settings, wire format, local DP-SGD, client and
server sides, mods, results) and the simulation stage."""
