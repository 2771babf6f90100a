"""`specd bench`: the proof that adaptation pays, through the real worker and controller."""
