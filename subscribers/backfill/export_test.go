package backfill

// SplitKeys is split: the segments a backfill of the keys low..high reads
// side by side.
var SplitKeys = split
