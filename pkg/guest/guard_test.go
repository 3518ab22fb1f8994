package guest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

const testDriver = "driver.harvesterhci.io"

// guestNode is a Ready guest Node whose kubelet has these volumes mounted:
// listed in use by kubelet and as attached by the attach/detach controller.
func guestNode(name string, mounted ...string) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name)}}
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}
	for _, v := range mounted {
		n.Status.VolumesInUse = append(n.Status.VolumesInUse, UniqueVolumeName(testDriver, v))
		n.Status.VolumesAttached = append(n.Status.VolumesAttached, corev1.AttachedVolume{Name: UniqueVolumeName(testDriver, v)})
	}
	return n
}

// awaiting is a guest Node whose kubelet lists these volumes in use for a
// pod that waits for them, while the attach/detach controller no longer
// reports them attached (it took them out before detaching).
func awaiting(n *corev1.Node, volumes ...string) *corev1.Node {
	for _, v := range volumes {
		n.Status.VolumesInUse = append(n.Status.VolumesInUse, UniqueVolumeName(testDriver, v))
	}
	return n
}

// guestPV is this driver's guest PV of a volume, named after it as the
// provisioner names it.
func guestPV(volume string) *corev1.PersistentVolume {
	return &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: volume},
		Spec: corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: testDriver, VolumeHandle: volume}}}}
}

func csiNode(name, vm string) *storagev1.CSINode {
	return &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: "other.csi", NodeID: "x"}, {Name: testDriver, NodeID: vm}}}}
}

type recordedEvent struct{ node, eventType, reason, message string }

type fakeEvents struct {
	mu  sync.Mutex
	got []recordedEvent
}

func (f *fakeEvents) NodeEvent(_ context.Context, node *corev1.Node, eventType, reason, message string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, recordedEvent{node.Name, eventType, reason, message})
}

func (f *fakeEvents) list() []recordedEvent {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]recordedEvent(nil), f.got...)
}

// attachment is the guest VolumeAttachment of the volume on a Node as the
// external-attacher keeps it once attached: with the node ID (the VM) it
// attached to.
func attachment(volume, node, vm string) *storagev1.VolumeAttachment {
	pv := volume
	return &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: AttachmentName(volume, testDriver, node), Annotations: map[string]string{"csi.alpha.kubernetes.io/node-id": vm}},
		Spec:       storagev1.VolumeAttachmentSpec{Attacher: testDriver, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv}},
	}
}

// deleting is the VolumeAttachment after the attach/detach controller
// deleted it at that time: the attacher's finalizer keeps it until the
// detach succeeds.
func deleting(va *storagev1.VolumeAttachment, at time.Time) *storagev1.VolumeAttachment {
	va.DeletionTimestamp = &metav1.Time{Time: at}
	va.Finalizers = []string{"external-attacher/driver-harvesterhci-io"}
	return va
}

// startNodes runs the caches over a fake clientset holding objs.
func startNodes(t *testing.T, objs ...runtime.Object) (*Nodes, *fake.Clientset) {
	t.Helper()
	client := fake.NewClientset(objs...)
	return startNodesOn(t, client), client
}

// startNodesOn runs new caches over client, as a restarted controller does.
func startNodesOn(t *testing.T, client *fake.Clientset) *Nodes {
	t.Helper()
	nodes, err := NewNodes(client, testDriver, 0)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	nodes.Start(stop)
	if !cache.WaitForCacheSync(stop, nodes.HasSynced, nodes.PVsSynced) {
		t.Fatal("caches did not sync")
	}
	return nodes
}

func TestNodesOfVM(t *testing.T) {
	nodes, _ := startNodes(t,
		guestNode("rke2-worker-1"), csiNode("rke2-worker-1", "vm-a"), // renamed guest: CSINode maps it
		guestNode("vm-b"),                          // not registered yet: same name as its VM
		guestNode("vm-c"), csiNode("vm-c", "vm-d"), // named like a VM but registered as another
	)
	for vm, want := range map[string]string{"vm-a": "rke2-worker-1", "vm-b": "vm-b", "vm-c": "", "vm-d": "vm-c", "vm-none": ""} {
		var got []string
		for _, n := range nodes.NodesOfVM(vm) {
			got = append(got, n.Name)
		}
		if strings.Join(got, ",") != want {
			t.Errorf("nodes of %s = %v, want %q", vm, got, want)
		}
	}
	for node, want := range map[string]string{"rke2-worker-1": "vm-a", "vm-b": "vm-b", "vm-c": "vm-d"} {
		if got := nodes.VMOfNode(node); got != want {
			t.Errorf("VM of %s = %s, want %s", node, got, want)
		}
	}
}

// TestNodesOfVMBeyondTheCSINode: the mappings that outlive the node
// plugin's registration find a VM's Node too: the node ID the
// external-attacher recorded on a VolumeAttachment, the providerID
// Harvester's cloud provider writes, and the last CSINode mapping seen.
// A Node whose CSINode names another VM now is not that VM's.
func TestNodesOfVMBeyondTheCSINode(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	byProvider := guestNode("rke2-pool-abc")
	byProvider.Spec.ProviderID = ProviderIDPrefix + "uid-vm-p"
	moved := attachment("pvc-x", "rke2-moved", "vm-old") // a stale record
	nodes, client := startNodes(t,
		guestNode("rke2-va"), attachment("pvc-a", "rke2-va", "vm-va"),
		byProvider,
		guestNode("rke2-seen"), csiNode("rke2-seen", "vm-seen"),
		guestNode("rke2-moved"), csiNode("rke2-moved", "vm-new"), moved,
		guestNode("vm-named"), // named like a VM, but last registered as another
		csiNode("vm-named", "vm-other"),
	)
	nodes.SetVMUIDs(func(vm string) (types.UID, bool) { return types.UID("uid-" + vm), vm == "vm-p" })
	for _, name := range []string{"rke2-seen", "vm-named"} {
		cn := csiNode(name, "")
		cn.Spec.Drivers = cn.Spec.Drivers[:1]
		if _, err := client.StorageV1().CSINodes().Update(ctx, cn, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	testwait.For(t, "the cache to show the driver unregistered", 10*time.Second, func() bool {
		return nodes.nodeID("rke2-seen") == "" && nodes.nodeID("vm-named") == ""
	})
	for vm, want := range map[string]string{"vm-va": "rke2-va", "vm-p": "rke2-pool-abc", "vm-seen": "rke2-seen", "vm-old": "", "vm-new": "rke2-moved", "vm-named": "", "vm-other": "vm-named"} {
		var got []string
		for _, n := range nodes.NodesOfVM(vm) {
			got = append(got, n.Name)
		}
		if strings.Join(got, ",") != want {
			t.Errorf("nodes of %s = %v, want %q", vm, got, want)
		}
	}
	if got := nodes.VMOfNode("rke2-seen"); got != "vm-seen" {
		t.Errorf("VM of rke2-seen after its registration went = %s, want vm-seen (last seen)", got)
	}
	// A deleted Node takes its last mapping along.
	if err := client.CoreV1().Nodes().Delete(ctx, "rke2-seen", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the deleted Node's mapping forgotten", 10*time.Second, func() bool { return nodes.VMOfNode("rke2-seen") == "rke2-seen" })
}

func TestNodesUsing(t *testing.T) {
	other := guestNode("worker-3")
	other.Status.VolumesInUse = append(other.Status.VolumesInUse, UniqueVolumeName("other.csi", "pvc-a"))
	nodes, _ := startNodes(t, guestNode("worker-2", "pvc-a", "pvc-b"), awaiting(guestNode("worker-1"), "pvc-a"), other)
	for vol, want := range map[string]string{"pvc-a": "worker-1,worker-2", "pvc-b": "worker-2", "pvc-c": ""} {
		var got []string
		for _, n := range nodes.NodesUsing(vol) {
			got = append(got, n.Name)
		}
		if strings.Join(got, ",") != want {
			t.Errorf("nodes using %s = %v, want %q", vol, got, want)
		}
	}
}

func TestGuardRefusesWhileInUseThenForces(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	nodes, _ := startNodes(t, guestNode("worker-1", "pvc-a"), csiNode("worker-1", "vm-1"))
	ev := &fakeEvents{}
	g := NewGuard(nodes, ev, 6*time.Minute)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	g.now = func() time.Time { return now }

	err := g.Allow(ctx, "vm-1", "pvc-a")
	var inUse *InUseError
	if !errors.As(err, &inUse) || inUse.Volume != "pvc-a" || inUse.VM != "vm-1" || strings.Join(inUse.Nodes, ",") != "worker-1" {
		t.Fatalf("first unplug of an in-use volume = %v, want InUseError naming volume, VM and node", err)
	}
	for _, want := range []string{"pvc-a", "worker-1", "vm-1", "still in use"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q lacks %q", err, want)
		}
	}
	// The count runs from the first refusal, not from each retry.
	now = now.Add(5 * time.Minute)
	if err := g.Allow(ctx, "vm-1", "pvc-a"); !errors.As(err, &inUse) || !inUse.Until.Equal(time.Date(2026, 1, 1, 0, 6, 0, 0, time.UTC)) {
		t.Fatalf("retry within the timeout = %v", err)
	}
	if len(ev.list()) != 0 {
		t.Fatalf("events before forcing: %v", ev.list())
	}
	now = now.Add(time.Minute)
	if err := g.Allow(ctx, "vm-1", "pvc-a"); err != nil {
		t.Fatalf("after the timeout the unplug must proceed: %v", err)
	}
	if err := g.Allow(ctx, "vm-1", "pvc-a"); err != nil {
		t.Fatalf("a retry of the forced unplug: %v", err)
	}
	got := ev.list()
	if len(got) != 1 || got[0].node != "worker-1" || got[0].eventType != corev1.EventTypeWarning || got[0].reason != "VolumeDetachForced" ||
		!strings.Contains(got[0].message, "pvc-a") || !strings.Contains(got[0].message, "vm-1") {
		t.Fatalf("want one Warning on worker-1 saying the unplug of pvc-a from vm-1 was forced, got %+v", got)
	}
	// Done ends the episode: a new unpublish counts from zero again.
	g.Done("vm-1", "pvc-a")
	if err := g.Allow(ctx, "vm-1", "pvc-a"); !errors.As(err, &inUse) {
		t.Fatalf("after Done the guard must count again: %v", err)
	}
}

func TestGuardLetsThrough(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	tainted := guestNode("worker-dead", "pvc-a")
	tainted.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeOutOfService, Effect: corev1.TaintEffectNoExecute}} // upstream's, no value
	nodes, client := startNodes(t,
		guestNode("worker-1", "pvc-other"), csiNode("worker-1", "vm-1"),
		tainted, csiNode("worker-dead", "vm-dead"),
		guestNode("worker-gone"), csiNode("worker-gone", "vm-gone"),
	)
	if err := client.CoreV1().Nodes().Delete(ctx, "worker-gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the deleted node gone from the cache", 10*time.Second, func() bool { _, ok := nodes.Node("worker-gone"); return !ok })
	g := NewGuard(nodes, nil, time.Hour)
	for what, vm := range map[string]string{
		"a volume the guest does not list": "vm-1",
		"a VM without guest node":          "vm-lonely",
		"a node tainted out of service":    "vm-dead",
		"a VM whose guest node is deleted": "vm-gone",
	} {
		if err := g.Allow(ctx, vm, "pvc-a"); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
}

// TestGuardLetsThroughAVolumeKubeletOnlyAwaits: kubelet lists a volume in
// use as soon as a new pod wants it, also while the attach/detach controller
// is detaching it from the pod before (it took the volume out of
// volumesAttached first, so kubelet cannot mount it). Refusing that unplug
// stalls the new pod for the whole guard timeout; only a volume still
// reported attached, or listed by a Node that is not Ready, is held. A cache
// that shows the volume awaited is confirmed with the API server first.
func TestGuardLetsThroughAVolumeKubeletOnlyAwaits(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	notReady := awaiting(guestNode("worker-silent"), "pvc-c")
	notReady.Status.Conditions[0].Status = corev1.ConditionUnknown
	// A partitioned Node of another VM still lists pvc-a from before the
	// attach/detach controller force-detached it there: not reported
	// attached, it says nothing about vm-1.
	partitioned := awaiting(guestNode("worker-partitioned"), "pvc-a")
	partitioned.Status.Conditions[0].Status = corev1.ConditionUnknown
	nodes, client := startNodes(t,
		awaiting(guestNode("worker-1"), "pvc-a"), csiNode("worker-1", "vm-1"),
		guestNode("worker-2", "pvc-b"), csiNode("worker-2", "vm-2"),
		notReady, csiNode("worker-silent", "vm-silent"),
		awaiting(guestNode("worker-stale"), "pvc-d"), csiNode("worker-stale", "vm-stale"),
		partitioned, csiNode("worker-partitioned", "vm-9"),
	)
	// The API server already has worker-stale's kubelet using the volume;
	// the cache has not seen it yet.
	client.PrependReactor("get", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.GetAction).GetName() != "worker-stale" {
			return false, nil, nil
		}
		return true, guestNode("worker-stale", "pvc-d"), nil
	})
	g := NewGuard(nodes, nil, time.Hour)
	if err := g.Allow(ctx, "vm-1", "pvc-a"); err != nil {
		t.Errorf("a volume a Ready node only awaits: %v, want the unplug to go ahead", err)
	}
	var inUse *InUseError
	for what, c := range map[string]struct{ vm, volume string }{
		"a volume listed in use and still reported attached":                {"vm-2", "pvc-b"},
		"a volume listed by a node that is not Ready":                       {"vm-silent", "pvc-c"},
		"a volume the cache shows awaited but the API server shows mounted": {"vm-stale", "pvc-d"},
	} {
		if err := g.Allow(ctx, c.vm, c.volume); !errors.As(err, &inUse) {
			t.Errorf("%s: %v, want InUseError", what, err)
		}
	}
	gets := 0
	for _, a := range client.Actions() {
		if a.GetVerb() == "get" && a.GetResource().Resource == "nodes" {
			gets++
		}
	}
	if gets != 2 {
		t.Errorf("%d live reads of guest nodes, want 2 (worker-1 and worker-stale, the ones the cache shows awaiting)", gets)
	}
}

// TestGuardHoldsWhileTheNodePluginRestarts: kubelet drops the driver from
// the CSINode while the node plugin restarts, and a crash-looping plugin is
// when an unmount does not finish. A Node that lists the volume in use and
// as attached holds it whatever the CSINode says, also for a controller that
// never saw the mapping; a Node that is not Ready is found through the node
// ID the external-attacher recorded on the VolumeAttachment.
func TestGuardHoldsWhileTheNodePluginRestarts(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	unregistered := func(name string) *storagev1.CSINode {
		return &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: "other.csi", NodeID: "x"}}}}
	}
	// node-c is not Ready; the attach/detach controller took pvc-c out of
	// volumesAttached to detach it anyway.
	silent := awaiting(guestNode("node-c"), "pvc-c")
	silent.Status.Conditions[0].Status = corev1.ConditionUnknown
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	nodes, client := startNodes(t,
		guestNode("node-b", "pvc-b"), csiNode("node-b", "g-b"),
		silent, unregistered("node-c"), deleting(attachment("pvc-c", "node-c", "g-c"), now),
	)
	ev := &fakeEvents{}
	g := NewGuard(nodes, ev, time.Hour)
	g.now = func() time.Time { return now }
	var inUse *InUseError
	if err := g.Allow(ctx, "g-b", "pvc-b"); !errors.As(err, &inUse) {
		t.Fatalf("while node-b is registered: %v, want InUseError", err)
	}
	if _, err := client.StorageV1().CSINodes().Update(ctx, unregistered("node-b"), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the cache to show node-b without the driver", 10*time.Second, func() bool { return nodes.nodeID("node-b") == "" })
	for what, g := range map[string]*Guard{"the same controller": g, "a restarted controller": NewGuard(startNodesOn(t, client), ev, time.Hour)} {
		g.now = func() time.Time { return now }
		if err := g.Allow(ctx, "g-b", "pvc-b"); !errors.As(err, &inUse) || strings.Join(inUse.Nodes, ",") != "node-b" {
			t.Errorf("%s, node plugin of node-b unregistered: %v, want InUseError naming node-b", what, err)
		}
		if err := g.Allow(ctx, "g-c", "pvc-c"); !errors.As(err, &inUse) || strings.Join(inUse.Nodes, ",") != "node-c" {
			t.Errorf("%s, node-c not Ready and unregistered: %v, want InUseError naming node-c", what, err)
		}
	}
	// The forced unplug's Warning still lands on the Node.
	now = now.Add(time.Hour)
	if err := g.Allow(ctx, "g-b", "pvc-b"); err != nil {
		t.Fatalf("after the timeout: %v", err)
	}
	if got := ev.list(); len(got) != 1 || got[0].node != "node-b" || got[0].reason != "VolumeDetachForced" {
		t.Errorf("events %+v, want one VolumeDetachForced on node-b", got)
	}
}

// TestGuardCountsFromTheDetachRequestAcrossRestarts: the timeout runs from
// the deletion of the VolumeAttachment, which the guest API server keeps,
// so a controller restarted more often than the timeout still lets the
// unplug through once it has passed. Another VM's VolumeAttachment of the
// volume, deleted long ago, does not count.
func TestGuardCountsFromTheDetachRequestAcrossRestarts(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	deleted := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	client := fake.NewClientset(
		guestNode("worker-1", "pvc-a"), csiNode("worker-1", "vm-1"), deleting(attachment("pvc-a", "worker-1", "vm-1"), deleted),
		guestNode("worker-2"), csiNode("worker-2", "vm-2"), deleting(attachment("pvc-a", "worker-2", "vm-2"), deleted.Add(-time.Hour)),
		guestNode("worker-3", "pvc-b"), csiNode("worker-3", "vm-3"), attachment("pvc-b", "worker-3", "vm-3"),
	)
	ev := &fakeEvents{}
	const timeout = 20 * time.Second
	// Each call is answered by a new controller: new caches, new guard.
	restarted := func(at time.Time, vm, volume string) error {
		g := NewGuard(startNodesOn(t, client), ev, timeout)
		g.now = func() time.Time { return at }
		return g.Allow(ctx, vm, volume)
	}
	var inUse *InUseError
	for _, after := range []time.Duration{0, 12 * time.Second, 19 * time.Second} {
		if err := restarted(deleted.Add(after), "vm-1", "pvc-a"); !errors.As(err, &inUse) || !inUse.Since.Equal(deleted) || !inUse.Until.Equal(deleted.Add(timeout)) {
			t.Fatalf("%s after the deletion: %v, want InUseError counting from the deletion", after, err)
		}
	}
	if err := restarted(deleted.Add(24*time.Second), "vm-1", "pvc-a"); err != nil {
		t.Fatalf("past the timeout since the deletion, after restarts: %v, want the unplug to go ahead", err)
	}
	if got := ev.list(); len(got) != 1 || got[0].node != "worker-1" || got[0].reason != "VolumeDetachForced" {
		t.Errorf("events %+v, want one VolumeDetachForced on worker-1", got)
	}
	// A VolumeAttachment that is not being deleted (an unpublish the
	// attach/detach controller did not ask for): the count starts at the
	// first refusal in this process.
	if err := restarted(deleted.Add(time.Hour), "vm-3", "pvc-b"); !errors.As(err, &inUse) || !inUse.Since.Equal(deleted.Add(time.Hour)) {
		t.Fatalf("without a deleted VolumeAttachment: %v, want InUseError counting from now", err)
	}
}

func TestGuardNotSynced(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	nodes, err := NewNodes(fake.NewClientset(), testDriver, 0)
	if err != nil {
		t.Fatal(err)
	}
	g := NewGuard(nodes, nil, time.Minute)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	g.now = func() time.Time { return now }
	if err := g.Allow(ctx, "vm-1", "pvc-a"); !errors.Is(err, ErrNotSynced) {
		t.Fatalf("before the caches sync = %v, want ErrNotSynced", err)
	}
	// A guest that never answers does not keep the volume for ever.
	now = now.Add(time.Minute)
	if err := g.Allow(ctx, "vm-1", "pvc-a"); err != nil {
		t.Fatalf("after the timeout without guest caches: %v, want the unplug to proceed", err)
	}
}

// Node Events go through the aggregating recorder: a repeat is one Event
// with a count, not a second object.
func TestRecorderWritesAggregatedNodeEvents(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := fake.NewClientset()
	r := NewRecorder(client, testDriver, "replica-1")
	defer r.Stop()
	for range 2 {
		r.NodeEvent(ctx, guestNode("worker-1"), corev1.EventTypeWarning, "VolumeDetachForced", "forced")
	}
	var got []corev1.Event
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	testwait.Until(wctx, t, "one Event counted twice", func() (bool, string) {
		list, err := client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		got = list.Items
		return len(got) == 1 && got[0].Count == 2, fmt.Sprintf("%d events", len(got))
	})
	e := got[0]
	if e.InvolvedObject.Kind != "Node" || e.InvolvedObject.Name != "worker-1" || e.InvolvedObject.UID != "uid-worker-1" ||
		e.Reason != "VolumeDetachForced" || e.Type != corev1.EventTypeWarning || e.Source.Component != testDriver || e.Source.Host != "replica-1" {
		t.Errorf("event %+v", e)
	}
}
