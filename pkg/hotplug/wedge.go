package hotplug

// A wedged intent: one that waits on a step only KubeVirt can take while
// KubeVirt shows no progress on the volume or the VM's hotplug set for
// Config.WedgedAfter (docs/architecture.md, "Wedged VMs"). It is noticed by
// the same per-volume wait bookkeeping that logs slow waits
// (noteWaitsLocked), told once per wedge to a WedgeReporter, counted in a
// gauge, shown in State and in a waiting caller's answer.

import (
	"context"
	"fmt"
	"strings"
	"time"

	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Reasons of a wedge: the KubeVirt step the intent waits for.
const (
	// WedgePlug: the volume is in the VM spec and KubeVirt does not get it
	// Ready in the VMI (attachment pod, mount, domain attach).
	WedgePlug = "plug"
	// WedgeUnplug: the volume left the VM spec and the VMI keeps it.
	WedgeUnplug = "unplug"
	// WedgePreviousAttachment: an attach waits for the VMI to drop the
	// volume's previous attachment, which does not go.
	WedgePreviousAttachment = "previous-attachment"
	// WedgeQueuedRequest: a legacy add request that KubeVirt's VM
	// controller does not take (its writes of the VM fail, e.g. denied by
	// a webhook).
	WedgeQueuedRequest = "queued-request"
)

// WedgeReasons lists every reason, as the metric exports them.
func WedgeReasons() []string {
	return []string{WedgePlug, WedgeUnplug, WedgePreviousAttachment, WedgeQueuedRequest}
}

// Wedge says on what, and since when, an intent is wedged in KubeVirt.
type Wedge struct {
	Reason string `json:"reason"`
	// Since is when KubeVirt last showed progress on the volume or the
	// VM's hotplug set (or when the wait on it began).
	Since time.Time `json:"since"`
	// State is what KubeVirt shows of the volume (the wait's text).
	State string `json:"state"`
	// AttachmentPod is the attachment pod the VMI names for the volume.
	AttachmentPod string `json:"attachmentPod,omitempty"`
	// Others are the VM's other hotplug entries KubeVirt has not settled
	// ("volume (phase, attachment pod)"): a removal there can hold every
	// add of the VM (virt-handler's mount loop before kubevirt v1.9.0).
	Others []string `json:"others,omitempty"`
	// VMFailure is the VM's Failure condition: KubeVirt's own writes of
	// the VM failing (Harvester's webhook denying them).
	VMFailure string `json:"vmFailure,omitempty"`
}

// Describe says it for a person, without the duration.
func (w Wedge) Describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s, no progress since %s", w.State, w.Since.UTC().Format(time.RFC3339))
	if w.AttachmentPod != "" {
		fmt.Fprintf(&b, "; attachment pod %s", w.AttachmentPod)
	}
	if len(w.Others) > 0 {
		fmt.Fprintf(&b, "; also not settled on the VM: %s", strings.Join(w.Others, ", "))
	}
	if w.VMFailure != "" {
		fmt.Fprintf(&b, "; the VM's last update failed: %s", w.VMFailure)
	}
	return b.String()
}

// WedgedError answers a caller whose deadline came while its intent was
// wedged in KubeVirt; the intent stays queued, as for any unfinished
// answer. Unwrap gives the context's error.
type WedgedError struct {
	Volume, VM string
	Op         Op
	Wedge      Wedge
	// For is how long KubeVirt had shown no progress when answered.
	For time.Duration
	Err error
}

func (e *WedgedError) Error() string {
	return fmt.Sprintf("%s of volume %s on VM %s is wedged in KubeVirt (%s for %s): %s; it stays queued and goes on by itself once KubeVirt moves (docs/troubleshooting.md, \"A VM wedged in KubeVirt\"): %v",
		e.Op, e.Volume, e.VM, e.Wedge.Reason, e.For.Round(time.Second), e.Wedge.Describe(), e.Err)
}

func (e *WedgedError) Unwrap() error { return e.Err }

// WedgeNotice is one change of a volume's wedge.
type WedgeNotice struct {
	VM, Volume string
	Op         Op
	Wedge      Wedge
	// Cleared says the wedge is over, and Resumed how: what KubeVirt shows
	// now, or that the intent no longer waits (done or replaced).
	Cleared bool
	Resumed string
}

// WedgeReporter hears each wedge once when it begins and once when it ends,
// never per pass or per caller. It is called from a queue worker outside
// the queue's lock; it must not block for long.
type WedgeReporter interface {
	ReportWedge(ctx context.Context, n WedgeNotice)
}

// SetWedgeReporter sets who hears of wedges. Call it before Run.
func (q *Queue) SetWedgeReporter(r WedgeReporter) {
	q.mu.Lock()
	q.wedges = r
	q.mu.Unlock()
}

// waitFor is what an intent waits for: why, for a person, and, when only
// KubeVirt can move, on which step (reason) and what KubeVirt shows (mark:
// any change of it is progress), with the wedge's details.
type waitFor struct {
	why    string
	reason string
	mark   string
	wedge  Wedge
}

// onKubeVirt is a wait on a KubeVirt step for vol. Only a running VMI can
// wedge: a stopped or starting one moves nothing until it runs, which is
// the VM's state, not a stuck hotplug.
func (o observed) onKubeVirt(vol, reason, why string) waitFor {
	if o.vmi == nil || o.vmi.Status.Phase != kubevirtv1.Running {
		return waitFor{why: why}
	}
	if ms := o.migration(); ms != nil {
		// A live migration holds every hotplug of the VM, however long it
		// takes (KubeVirt allows 150 s per GiB): the VM's state, not a
		// stuck hotplug. Its end starts the bound again.
		return waitFor{why: fmt.Sprintf("%s; the VMI is in a live migration from host node %s to %s, and KubeVirt carries out no hotplug until it ends",
			why, ms.SourceNode, ms.TargetNode)}
	}
	w := Wedge{Reason: reason, State: why}
	if s := o.status(vol); s != nil && s.HotplugVolume != nil {
		w.AttachmentPod = s.HotplugVolume.AttachPodName
	}
	for _, other := range o.unsettled() {
		if other != vol {
			w.Others = append(w.Others, o.entry(other))
		}
	}
	if o.vm != nil {
		w.VMFailure = failure(o.vm)
	}
	return waitFor{why: why, reason: reason, mark: o.volumeMark(vol) + "|" + o.progressMark(), wedge: w}
}

// volumeMark fingerprints what KubeVirt shows of one volume: in the VM
// spec, queued requests, in the VMI spec, and its status entry's phase,
// target and attachment pod. Reasons and messages are left out: KubeVirt
// rewrites them on every failed retry, which is no progress.
func (o observed) volumeMark(vol string) string {
	add, remove := o.requested(vol)
	m := fmt.Sprintf("%t/%t/%t/%t", o.inVMSpec(vol), add, remove, o.inVMISpec(vol))
	if s := o.status(vol); s != nil {
		m += fmt.Sprintf("/%s/%t", s.Phase, s.Target != "")
		if h := s.HotplugVolume; h != nil {
			m += "/" + h.AttachPodName + "/" + string(h.AttachPodUID)
		}
	}
	return m
}

// entry describes another volume's hotplug entry for a wedge's details.
func (o observed) entry(vol string) string {
	s := o.status(vol)
	switch {
	case s == nil:
		return vol + " (queued request)"
	case s.HotplugVolume != nil && s.HotplugVolume.AttachPodName != "":
		return fmt.Sprintf("%s (%s, attachment pod %s)", vol, s.Phase, s.HotplugVolume.AttachPodName)
	default:
		return fmt.Sprintf("%s (%s)", vol, s.Phase)
	}
}

// failure is the VM's Failure condition, "" when it has none.
func failure(vm *kubevirtv1.VirtualMachine) string {
	for _, c := range vm.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineFailure && c.Status == "True" {
			return strings.TrimSpace(c.Reason + ": " + c.Message)
		}
	}
	return ""
}

// trackWedgeLocked moves one volume's wedge on: a new step or a change of
// what KubeVirt shows starts the clock again (and ends a wedge), a wait on
// KubeVirt that has not moved for WedgedAfter becomes a wedge. It returns
// the notice to give, if any, and when to look again (zero: no need).
func (q *Queue) trackWedgeLocked(ctx context.Context, key cache.ObjectName, vol string, op Op, st *waitState, wf waitFor, now time.Time) (*WedgeNotice, time.Time) {
	var notice *WedgeNotice
	if st.reason != wf.reason || st.mark != wf.mark {
		if st.wedged {
			notice = &WedgeNotice{VM: key.Name, Volume: vol, Op: st.op, Wedge: st.wedge, Cleared: true, Resumed: wf.why}
			klog.FromContext(ctx).Info("hotplug request no longer wedged: KubeVirt moved", "volume", vol, "op", st.op, "reason", st.wedge.Reason, "now", wf.why)
		}
		st.reason, st.mark, st.still, st.wedged = wf.reason, wf.mark, now, false
	}
	st.op = op
	if st.reason == "" {
		return notice, time.Time{}
	}
	st.wedge = wf.wedge
	st.wedge.Since = st.still
	if st.wedged {
		return notice, time.Time{}
	}
	if at := st.still.Add(q.cfg.WedgedAfter); now.Before(at) {
		return notice, at
	}
	st.wedged = true
	klog.FromContext(ctx).Info("hotplug request wedged in KubeVirt", "volume", vol, "op", op, "reason", st.reason,
		"state", wf.why, "attachmentPod", st.wedge.AttachmentPod, "others", st.wedge.Others, "since", st.still, "for", now.Sub(st.still).Round(time.Second))
	return &WedgeNotice{VM: key.Name, Volume: vol, Op: op, Wedge: st.wedge}, time.Time{}
}

// endWedgeLocked is the notice for a wedged wait that ended because its
// intent no longer waits (answered, replaced or gone).
func endWedgeLocked(key cache.ObjectName, vol string, st waitState) *WedgeNotice {
	if !st.wedged {
		return nil
	}
	return &WedgeNotice{VM: key.Name, Volume: vol, Op: st.op, Wedge: st.wedge, Cleared: true, Resumed: "the request no longer waits (done or replaced)"}
}

// reportWedges gives the notices of one pass, outside the queue's lock.
func (q *Queue) reportWedges(ctx context.Context, notices []WedgeNotice) {
	if len(notices) == 0 {
		return
	}
	q.mu.Lock()
	r := q.wedges
	q.mu.Unlock()
	if r == nil {
		return
	}
	for _, n := range notices {
		r.ReportWedge(ctx, n)
	}
}

// hasWedge says whether a wait of the VM is wedged.
func hasWedge(w *vmWork) bool {
	for _, st := range w.waiting {
		if st.wedged {
			return true
		}
	}
	return false
}

// wedgedLocked counts the wedged intents by reason.
func (q *Queue) wedgedLocked() map[string]int {
	out := map[string]int{}
	for _, w := range q.work {
		for _, st := range w.waiting {
			if st.wedged {
				out[st.reason]++
			}
		}
	}
	return out
}

// migration is the VMI's live migration while it runs, else nil: started and
// not ended, the test virt-handler makes before it leaves a VMI alone
// (kubevirt v1.7.0 pkg/virt-handler/controller.go:308-315, used at
// vm.go:391-394). Only the timestamps are read, so the answer does not
// depend on the clock.
func (o observed) migration() *kubevirtv1.VirtualMachineInstanceMigrationState {
	if o.vmi == nil {
		return nil
	}
	if ms := o.vmi.Status.MigrationState; ms != nil && ms.StartTimestamp != nil && ms.EndTimestamp == nil {
		return ms
	}
	return nil
}
