"""What a rank reports: step metrics, the recorder, the attempt clock, heartbeats, the MFU peak."""
