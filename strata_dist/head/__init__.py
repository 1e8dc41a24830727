"""The launcher's side beside the coordinator: the coordinator and a lost rank's rejoin, the head
session (a conversation's reusable prefix), the batch scheduler, the kept conversations' table."""
