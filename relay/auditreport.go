package relay

import (
	"fmt"
	"strings"
)

// AuditReport is what one audit checked and found.
type AuditReport struct {
	// Checked events; Missing from the stream (or published with no
	// landing recorded, Unrecorded of them); Repaired, published again;
	// AgedOut: below the stream's first sequence (its own limits removed
	// them) after every consumer acknowledged them, not missing;
	// AgedUnconsumed: removed before some consumer acknowledged them,
	// counted in Missing too.
	Checked, Missing, Unrecorded, Repaired, AgedOut, AgedUnconsumed int64
	// Lost: missing events whose rows are gone too, which no repair can
	// bring back (the first few).
	Lost []int64
	// Altered events are in the stream with their identity and other
	// content than their rows' (checked by a range's audit only);
	// AlteredIDs are the first few.
	Altered    int64
	AlteredIDs []int64
}

func (a *AuditReport) add(b AuditReport) {
	a.Checked += b.Checked
	a.Missing += b.Missing
	a.Unrecorded += b.Unrecorded
	a.Repaired += b.Repaired
	a.AgedOut += b.AgedOut
	a.AgedUnconsumed += b.AgedUnconsumed
	a.Lost = append(a.Lost, b.Lost...)
	if len(a.Lost) > maxLostListed {
		a.Lost = a.Lost[:maxLostListed]
	}
	a.Altered += b.Altered
	a.AlteredIDs = append(a.AlteredIDs, b.AlteredIDs...)
	if len(a.AlteredIDs) > maxLostListed {
		a.AlteredIDs = a.AlteredIDs[:maxLostListed]
	}
}

const maxLostListed = 20

func (a AuditReport) detail() string {
	var parts []string
	if a.Unrecorded > 0 {
		parts = append(parts, fmt.Sprintf("%d published with no landing recorded", a.Unrecorded))
	}
	if a.AgedOut > 0 {
		parts = append(parts, fmt.Sprintf("%d below the stream's first sequence (removed by its limits)", a.AgedOut))
	}
	if a.AgedUnconsumed > 0 {
		parts = append(parts, fmt.Sprintf("%d removed by the stream's limits before a consumer acknowledged them", a.AgedUnconsumed))
	}
	if a.Missing > a.Repaired {
		parts = append(parts, fmt.Sprintf("%d not repaired", a.Missing-a.Repaired))
	}
	if len(a.Lost) > 0 {
		parts = append(parts, fmt.Sprintf("rows gone for events %v", a.Lost))
	}
	if a.Altered > 0 {
		parts = append(parts, fmt.Sprintf("%d altered: in the stream with other content than their rows' (events %v)", a.Altered, a.AlteredIDs))
	}
	return strings.Join(parts, "; ")
}
