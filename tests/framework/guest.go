package framework

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
)

// Guest is a guest cluster's control plane: a real API server with no
// kubelet, whose Nodes and CSINodes a test writes as kubelet and the
// node-driver-registrar would.
type Guest struct {
	Env  *testenv.Env
	Kube kubernetes.Interface
}

// StartGuest starts a guest API server; it is stopped when tb ends.
func StartGuest(tb testing.TB) *Guest {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	env, err := testenv.Start(ctx, testenv.Options{})
	if err != nil {
		tb.Fatalf("start guest control plane: %v", err)
	}
	tb.Cleanup(env.Stop)
	return &Guest{Env: env, Kube: kubernetes.NewForConfigOrDie(env.Config)}
}

// AddNode registers a Ready guest Node running on VM vm, and its CSINode
// giving this driver the node ID vm (the Node name may differ).
func (g *Guest) AddNode(tb testing.TB, name, vm string) {
	tb.Helper()
	ctx := context.Background()
	if _, err := g.Kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		tb.Fatal(err)
	}
	if _, err := g.Kube.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver.Name, NodeID: vm}}},
	}, metav1.CreateOptions{}); err != nil {
		tb.Fatal(err)
	}
	g.SetReady(tb, name, corev1.ConditionTrue)
}

// AddPVs creates the guest PVs of host volumes, as the external-provisioner
// does: a guest PV of this driver naming a host PVC is what makes the
// volume this guest cluster's.
func (g *Guest) AddPVs(tb testing.TB, vols ...string) {
	tb.Helper()
	for _, vol := range vols {
		pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: vol}, Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver.Name, VolumeHandle: vol}},
		}}
		if _, err := g.Kube.CoreV1().PersistentVolumes().Create(context.Background(), pv, metav1.CreateOptions{}); err != nil {
			tb.Fatal(err)
		}
	}
}

// UpdateNodeStatus changes a guest Node's status as kubelet or the node
// lifecycle controller would.
func (g *Guest) UpdateNodeStatus(tb testing.TB, name string, mutate func(*corev1.NodeStatus)) {
	tb.Helper()
	ctx := context.Background()
	err := retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		n, err := g.Kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		mutate(&n.Status)
		_, err = g.Kube.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// SetReady sets the Node's Ready condition.
func (g *Guest) SetReady(tb testing.TB, name string, ready corev1.ConditionStatus) {
	tb.Helper()
	g.UpdateNodeStatus(tb, name, func(st *corev1.NodeStatus) {
		now := metav1.Now()
		st.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: ready, LastHeartbeatTime: now, LastTransitionTime: now, Reason: "Test"}}
	})
}

// SetMounted sets the Node's volume status to what it shows while kubelet
// has these volumes of this driver mounted: listed in volumesInUse by
// kubelet and in volumesAttached by the attach/detach controller.
func (g *Guest) SetMounted(tb testing.TB, name string, volumes ...string) {
	tb.Helper()
	g.setVolumes(tb, name, volumes, volumes)
}

// SetAwaiting sets the Node's volume status to what it shows while pods on
// it wait for these volumes: listed in volumesInUse, not in volumesAttached
// (not attached yet, or being detached from an earlier pod).
func (g *Guest) SetAwaiting(tb testing.TB, name string, volumes ...string) {
	tb.Helper()
	g.setVolumes(tb, name, volumes, nil)
}

func (g *Guest) setVolumes(tb testing.TB, name string, inUse, attached []string) {
	tb.Helper()
	g.UpdateNodeStatus(tb, name, func(st *corev1.NodeStatus) {
		st.VolumesInUse, st.VolumesAttached = nil, nil
		for _, v := range inUse {
			st.VolumesInUse = append(st.VolumesInUse, guest.UniqueVolumeName(driver.Name, v))
		}
		for _, v := range attached {
			st.VolumesAttached = append(st.VolumesAttached, corev1.AttachedVolume{Name: guest.UniqueVolumeName(driver.Name, v)})
		}
	})
}

// NodeEvents lists the Events written on a guest Node.
func (g *Guest) NodeEvents(tb testing.TB, node string) []corev1.Event {
	tb.Helper()
	return g.ObjectEvents(tb, "Node", node)
}

// ObjectEvents lists the Events written on a guest object of this kind and
// name (cluster-scoped objects' Events live in the default namespace).
func (g *Guest) ObjectEvents(tb testing.TB, kind, name string) []corev1.Event {
	tb.Helper()
	list, err := g.Kube.CoreV1().Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{
		FieldSelector: fields.Set{"involvedObject.kind": kind, "involvedObject.name": name}.String(),
	})
	if err != nil {
		tb.Fatal(err)
	}
	return list.Items
}

// WaitNodeEvents waits until the guest Node has an Event of that reason and
// returns the Events of that reason: the controller's recorder writes them
// in the background, after the decision they report.
func (g *Guest) WaitNodeEvents(tb testing.TB, node, reason string) []corev1.Event {
	tb.Helper()
	var got []corev1.Event
	testwait.For(tb, "an Event "+reason+" on guest Node "+node, time.Minute, func() bool {
		got = got[:0]
		for _, e := range g.NodeEvents(tb, node) {
			if e.Reason == reason {
				got = append(got, e)
			}
		}
		return len(got) > 0
	})
	return got
}
