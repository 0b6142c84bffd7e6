"""The control plane and the world every rank lives in: the bottom layer of `rankd`, importing no other part of it.

Owns the job's world (device and backend detection, the process group: `world`), the control-plane protocol and
its ZeroMQ channel, heartbeats, process lifetime, the command table and dispatch (`dispatch`), running a cell
with its output captured (`capture`), agreeing that a command's input is valid before any collective
(`agreement`), and the follower loop (`follower`).
"""
