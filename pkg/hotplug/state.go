package hotplug

import (
	"cmp"
	"slices"
	"time"
)

// VMState is what the queue is doing for one VM, for operators (a
// diagnostic view, Events) and never for decisions.
type VMState struct {
	VM      string        `json:"vm"`
	Intents []IntentState `json:"intents,omitempty"`
	// Hold says why the VM's pending changes are not written yet.
	Hold string `json:"hold,omitempty"`
	// LastError is the VM's last failed attempt at the host, if the
	// attempts are failing, and FailingSince when they began to.
	LastError    string    `json:"lastError,omitempty"`
	FailingSince time.Time `json:"failingSince,omitzero"`
	// Unobserved lists the volumes with a write of this process that the
	// informers have not shown yet.
	Unobserved []string `json:"unobserved,omitempty"`
}

// IntentState is one pending intent.
type IntentState struct {
	Volume string    `json:"volume"`
	Op     Op        `json:"op"`
	Since  time.Time `json:"since"`
	// WaitingFor says what the intent waits for (empty: it is being
	// written), and WaitingSince since when.
	WaitingFor   string    `json:"waitingFor,omitempty"`
	WaitingSince time.Time `json:"waitingSince,omitzero"`
	// Wedged is set while the intent is wedged in KubeVirt.
	Wedged *Wedge `json:"wedged,omitempty"`
}

// State lists what the queue is doing, VM by VM.
func (q *Queue) State() []VMState {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := make([]VMState, 0, len(q.work))
	for _, key := range sortedNames(q.work) {
		w := q.work[key]
		st := VMState{VM: key.Name, Hold: w.hold, FailingSince: w.failingSince, Unobserved: sortedKeys(w.expect)}
		if w.lastErr != nil {
			st.LastError = w.lastErr.Error()
		}
		for _, vol := range sortedKeys(w.intents) {
			it := w.intents[vol]
			wait := w.waiting[vol]
			is := IntentState{Volume: vol, Op: it.op, Since: it.created, WaitingFor: wait.why, WaitingSince: wait.since}
			if wait.wedged {
				wedge := wait.wedge
				is.Wedged = &wedge
			}
			st.Intents = append(st.Intents, is)
		}
		slices.SortFunc(st.Intents, func(a, b IntentState) int { return cmp.Compare(a.Volume, b.Volume) })
		out = append(out, st)
	}
	return out
}
