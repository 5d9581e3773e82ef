"""What a training rank reports."""
