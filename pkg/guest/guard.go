package guest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// DefaultDetachGuardTimeout is how long the guard holds a volume for a guest
// that still uses it: the attach/detach controller's own bound
// (maxWaitForUnmountDuration) before it force-detaches.
const DefaultDetachGuardTimeout = 6 * time.Minute

// ErrNotSynced answers while the guest caches are not filled yet: the guard
// cannot tell whether the guest still uses the volume.
var ErrNotSynced = errors.New("the guest Node, CSINode and VolumeAttachment caches have not synced yet")

// InUseError refuses an unplug while the guest still lists the volume as in
// use: kubelet has not unmounted it (the attach/detach controller can call
// ControllerUnpublish before NodeUnstage, or without it).
type InUseError struct {
	Volume, VM string
	Nodes      []string
	// Since is where the count starts (the VolumeAttachment's deletion, else
	// the first refusal in this process), Until when the guard gives up.
	Since, Until time.Time
}

func (e *InUseError) Error() string {
	return fmt.Sprintf("volume %s is still in use by guest node %s (listed in its status.volumesInUse while still reported attached, or while the node is not Ready: kubelet may still have it mounted): not unplugging it from VM %s yet; counting since %s, unplugged anyway after %s",
		e.Volume, strings.Join(e.Nodes, ", "), e.VM, e.Since.UTC().Format(time.RFC3339), e.Until.UTC().Format(time.RFC3339))
}

// EventSink writes an Event on a guest Node.
type EventSink interface {
	NodeEvent(ctx context.Context, node *corev1.Node, eventType, reason, message string)
}

// Guard decides whether a volume may be unplugged from a VM now. It reads the
// guest Nodes: while kubelet on one of them may have the volume mounted (see
// users), unplugging would pull the disk from under a mounted filesystem, so
// the guard refuses, up to Timeout counted from the deletion of the volume's
// VolumeAttachment on the VM (which outlives restarts and leader changes), or
// from the first refusal in this process when no VolumeAttachment is being
// deleted; then it lets the unplug through and says so in an Event on the
// Node. A VM without guest Node, a Node that is gone and a Node tainted out
// of service (its kubelet is declared dead) never block.
type Guard struct {
	nodes   *Nodes
	events  EventSink
	timeout time.Duration
	now     func() time.Time

	mu      sync.Mutex
	refused map[refusalKey]*refusal
}

type refusalKey struct{ vm, volume string }

type refusal struct {
	first, last time.Time
	forced      bool
}

// NewGuard builds a guard over the guest caches; events may be nil.
func NewGuard(nodes *Nodes, events EventSink, timeout time.Duration) *Guard {
	return &Guard{nodes: nodes, events: events, timeout: timeout, now: time.Now, refused: map[refusalKey]*refusal{}}
}

// Allow returns nil when the volume may be unplugged from vm now, an
// *InUseError while the guest still uses it, or an error wrapping
// ErrNotSynced while the guest caches cannot tell; either only until the
// timeout has passed since the detach was asked for (see since).
func (g *Guard) Allow(ctx context.Context, vm, volume string) error {
	// Unsynced caches (a guest API that does not answer, an identity the
	// guest refuses) cannot say the volume is free, but they must not keep
	// it on the VM for ever either: they count toward the same timeout.
	synced := g.nodes.HasSynced()
	var users []*corev1.Node
	var requested time.Time
	if synced {
		own := g.nodes.NodesOfVM(vm)
		users = g.users(ctx, vm, volume, own)
		requested = g.detachRequested(vm, volume, slices.Concat(own, users))
	}
	key := refusalKey{vm, volume}
	now := g.now()
	g.mu.Lock()
	g.pruneLocked(now)
	if synced && len(users) == 0 {
		delete(g.refused, key)
		g.mu.Unlock()
		return nil
	}
	r := g.refused[key]
	if r == nil {
		r = &refusal{first: now}
		g.refused[key] = r
	}
	r.last = now
	since := r.first
	if !requested.IsZero() && requested.Before(since) {
		since = requested
	}
	until := since.Add(g.timeout)
	// Once forced, an unplug stays let through: its VolumeAttachment may
	// be gone by the caller's retry.
	forced := r.forced || !now.Before(until)
	already := r.forced
	r.forced = forced
	g.mu.Unlock()
	names := make([]string, len(users))
	for i, n := range users {
		names[i] = n.Name
	}
	if !forced {
		if !synced {
			return fmt.Errorf("%w (volume %s on VM %s is unplugged without asking the guest after %s)", ErrNotSynced, volume, vm, until.UTC().Format(time.RFC3339))
		}
		klog.FromContext(ctx).V(2).Info("unplug refused: the guest still uses the volume", "volume", volume, "vm", vm, "guestNodes", names, "since", since, "until", until)
		return &InUseError{Volume: volume, VM: vm, Nodes: names, Since: since, Until: until}
	}
	if already {
		return nil
	}
	if !synced {
		klog.FromContext(ctx).Error(ErrNotSynced, "unplugging without asking the guest: its caches never synced within the detach guard's timeout", "volume", volume, "vm", vm, "refusedSince", since)
		return nil
	}
	msg := fmt.Sprintf("volume %s is being unplugged from VM %s although this node still lists it in status.volumesInUse: the detach guard waited %s since %s (--detach-guard-timeout) for kubelet to unmount it",
		volume, vm, g.timeout, since.UTC().Format(time.RFC3339))
	klog.FromContext(ctx).Info("forcing an unplug the guest still uses", "volume", volume, "vm", vm, "guestNodes", names, "since", since)
	if g.events != nil {
		for _, n := range users {
			g.events.NodeEvent(ctx, n, corev1.EventTypeWarning, "VolumeDetachForced", msg)
		}
	}
	return nil
}

// detachRequested is where the count of an unplug's wait starts: the
// deletion of the volume's VolumeAttachment on vm when one is being deleted
// (the guest API server keeps it across controller restarts and leader
// changes). Zero when none is: then the count starts at the first refusal in
// this process (an unpublish the attach/detach controller did not ask for).
func (g *Guard) detachRequested(vm, volume string, nodes []*corev1.Node) time.Time {
	names := make([]string, len(nodes))
	for i, n := range nodes {
		names[i] = n.Name
	}
	t, _ := g.nodes.DetachRequested(vm, volume, names)
	return t
}

// users returns the guest Nodes that may still have the volume mounted
// while vm holds it. For a Node of vm (own) that is mayBeMounted; a Node the
// cache shows only waiting for the volume (listed in use, no longer reported
// attached) is read again from the API server first: letting the unplug
// through on a stale cache could pull the disk from a kubelet that has
// mounted it since. A Node that cannot be read counts as a user; one that is
// gone does not. Any other Node counts when it lists the volume in use and
// as attached: the mapping from VM to Node can fail (kubelet drops the
// driver from the CSINode while the node plugin restarts), but a
// single-node volume that vm holds is reported attached only on vm's Node
// (see docs/architecture.md, "Detach guard").
func (g *Guard) users(ctx context.Context, vm, volume string, own []*corev1.Node) []*corev1.Node {
	return g.nodes.users(ctx, vm, volume, own)
}

// users is the guard's rule (Guard.users), shared with the orphan
// reconciler, which must never unplug what the guard would hold.
func (n *Nodes) users(ctx context.Context, vm, volume string, own []*corev1.Node) []*corev1.Node {
	var users []*corev1.Node
	for _, node := range n.NodesUsing(volume) {
		if slices.ContainsFunc(own, func(o *corev1.Node) bool { return o.Name == node.Name }) ||
			OutOfService(node) || !reportedAttached(node, n.driver, volume) {
			continue
		}
		klog.FromContext(ctx).V(2).Info("a guest node not known to run the VM lists the volume in use and attached: counting it as the VM's", "volume", volume, "vm", vm, "guestNode", node.Name)
		users = append(users, node)
	}
	for _, node := range own {
		if OutOfService(node) || !inUse(node, n.driver, volume) {
			continue
		}
		if mayBeMounted(node, n.driver, volume) {
			users = append(users, node)
			continue
		}
		live, err := n.client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			klog.FromContext(ctx).Error(err, "cannot read the guest node again: counting it as still using the volume", "volume", volume, "vm", vm, "guestNode", node.Name)
			users = append(users, node)
		case !OutOfService(live) && mayBeMounted(live, n.driver, volume):
			users = append(users, live)
		default:
			klog.FromContext(ctx).V(2).Info("the guest lists the volume in use but no longer attached: its kubelet waits for the volume to come back, not using it", "volume", volume, "vm", vm, "guestNode", node.Name)
		}
	}
	slices.SortFunc(users, func(a, b *corev1.Node) int { return strings.Compare(a.Name, b.Name) })
	return users
}

// Done forgets what the guard counted for the volume on vm: the unplug
// finished, or the volume was published to the VM again.
func (g *Guard) Done(vm, volume string) {
	g.mu.Lock()
	delete(g.refused, refusalKey{vm, volume})
	g.mu.Unlock()
}

// pruneLocked drops refusals nobody asked about for long: the
// VolumeAttachment went away some other way. The external-attacher retries
// a detach at least every few minutes, so a refusal still being asked about
// keeps its count.
func (g *Guard) pruneLocked(now time.Time) {
	idle := max(2*g.timeout, 15*time.Minute)
	for k, r := range g.refused {
		if now.Sub(r.last) > idle {
			delete(g.refused, k)
		}
	}
}

// OutOfServiceTaint is the taint of Kubernetes' non-graceful node shutdown:
// with it, the attach/detach controller detaches at once and pod GC deletes
// the Node's terminating pods. Kubernetes matches the key only; the value is
// the one its documentation uses.
var OutOfServiceTaint = corev1.Taint{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}

// OutOfService reports whether the Node carries the out-of-service taint
// with effect NoExecute (any value: an administrator's or upstream's taint,
// which has none, counts too).
func OutOfService(node *corev1.Node) bool {
	for _, t := range node.Spec.Taints {
		if t.Key == OutOfServiceTaint.Key && t.Effect == corev1.TaintEffectNoExecute {
			return true
		}
	}
	return false
}
