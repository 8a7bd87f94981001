"""Helpers the tests share: reward plugins named by import path, and a loopback HTTP server runner."""
