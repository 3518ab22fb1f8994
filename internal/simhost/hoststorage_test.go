package simhost

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestHostNodesNeedHostStorage(t *testing.T) {
	for _, o := range []Options{
		{HostNodes: 2},
		{Placement: map[string]string{"vm": "harvester-0"}},
		{Real: "v1.7.0", HostStorage: true, Placement: map[string]string{"vm": "elsewhere"}},
		{RealRelease: "v1.7.4"},
	} {
		if h, err := Start(context.Background(), o); err == nil {
			_ = h.Stop(context.Background())
			t.Errorf("Start(%+v) succeeded, want a refusal", o)
		}
	}
}

// With host storage, on KubeVirt's real control plane and on the simulated
// one alike, a hot-plug goes the way it goes on Harvester: the attachment
// pod is placed by the scheduler on its VM's host node, the attach/detach
// controller asks for the Longhorn volume there, the external-attacher's
// ControllerPublish gets its Longhorn ticket satisfied, the kubelet
// publishes the volume, and only then is the VMI entry Ready. The unplug
// lets go in the host's order: the host VolumeAttachment goes only after
// the pod is gone and the node no longer lists the volume in use.
func TestHotplugThroughTheHostStoragePath(t *testing.T) {
	for _, tc := range []struct {
		name    string
		real    string
		sim     kubevirtsim.Options
		declare bool
	}{
		{name: "real-v1.7.0-legacy", real: "v1.7.0", sim: kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy}},
		{name: "sim-v1.5.3-legacy", sim: kubevirtsim.Options{Version: kubevirtsim.V1_5_3, Mode: kubevirtsim.ModeLegacy, Scale: 0.05}},
		{name: "sim-v1.7.0-declarative", sim: kubevirtsim.Options{Version: kubevirtsim.V1_7_0, Mode: kubevirtsim.ModeDeclarative, Scale: 0.05}},
	} {
		t.Run(tc.name, func(t *testing.T) { hotplugThroughHostStorage(t, tc.real, tc.sim) })
	}
}

func hotplugThroughHostStorage(t *testing.T, real string, so kubevirtsim.Options) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	h := startOnHostNodes(ctx, t, real, so, map[string]string{"node-0": "harvester-1"})
	// After node-0, so that the scheduler sees it when it places node-1.
	if err := h.CreateVMs(ctx, "node-1"); err != nil {
		t.Fatal(err)
	}
	host := h.HostNodeOf(ctx, "node-0")
	if host != "harvester-1" {
		t.Fatalf("node-0's VM runs on %q, want harvester-1 where Placement pins it", host)
	}
	if other := h.HostNodeOf(ctx, "node-1"); other == host || !slices.Contains(h.HostNodes(), other) {
		t.Errorf("node-1's VM runs on %q, want another host node than node-0's %s", other, host)
	}
	kv := kubeVirtOf(t, h)
	vols, lhName := hotplugOneVolume(ctx, t, h, kv, "node-0")
	lv, err := h.Longhorn.Volume(ctx, lhName)
	if err != nil {
		t.Fatalf("no Longhorn volume behind PV %s: %v", lhName, err)
	}
	if !lv.Spec.Migratable {
		t.Errorf("Longhorn volume %s of an RWX block claim of Harvester's class is not migratable", lhName)
	}
	vms := kv.KubevirtV1().VirtualMachines(h.Namespace)

	// Whatever is seen Ready must have every host stage done before it.
	var pod *corev1.Pod
	testwait.Until(ctx, t, "the VMI entry Ready", func() (bool, string) {
		_, vmi := h.VM(ctx, "node-0")
		if vmi == nil {
			return false, "no VMI"
		}
		for _, e := range vmi.Status.VolumeStatus {
			if e.Name == vols[0] {
				return e.Phase == kubevirtv1.VolumeReady, fmt.Sprintf("%+v", e)
			}
		}
		return false, "no entry"
	})
	pod = attachmentPod(ctx, t, h)
	if pod == nil {
		t.Fatal("VMI entry Ready without an attachment pod")
	}
	if pod.Spec.NodeName != host {
		t.Errorf("attachment pod %s is on %q, want the VM's host node %s", pod.Name, pod.Spec.NodeName, host)
	}
	if !affinityTo(pod, host) {
		t.Errorf("attachment pod %s has affinity %+v, want KubeVirt's required node affinity to %s", pod.Name, pod.Spec.Affinity, host)
	}
	if !scheduledByScheduler(ctx, t, h, pod) {
		t.Errorf("attachment pod %s was not placed by the scheduler", pod.Name)
	}
	va, err := hostVolumeAttachment(ctx, h, lhName)
	if err != nil {
		t.Fatal(err)
	}
	if va == nil || va.Spec.NodeName != host || !va.Status.Attached {
		t.Fatalf("host VolumeAttachment of %s: %+v, want attached to %s by the external-attacher", lhName, va, host)
	}
	lva, err := h.Longhorn.VolumeAttachment(ctx, lhName)
	if err != nil {
		t.Fatal(err)
	}
	if !lva.Satisfied(simlonghorn.AttachmentID(lhName, host)) {
		t.Errorf("Longhorn ticket of %s on %s not satisfied: %+v", lhName, host, lva)
	}
	target := filepath.Join(h.nodes.dir, host, "plugins/kubernetes.io/csi/volumeDevices/publish", lhName, string(pod.UID))
	if _, err := os.Stat(target); err != nil {
		t.Errorf("the kubelet did not publish %s for pod %s: %v", lhName, pod.Name, err)
	}

	// Unplug: the host lets go only after the pod and the node's use.
	if err := vms.RemoveVolume(ctx, "node-0", &kubevirtv1.RemoveVolumeOptions{Name: vols[0]}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the host VolumeAttachment deleted", func() (bool, string) {
		va, err := hostVolumeAttachment(ctx, h, lhName)
		if err != nil {
			return false, err.Error()
		}
		if va != nil {
			return false, fmt.Sprintf("attached %v, deleting %v", va.Status.Attached, va.DeletionTimestamp != nil)
		}
		if p, err := h.Kube.CoreV1().Pods(h.Namespace).Get(ctx, pod.Name, metav1.GetOptions{}); err == nil {
			t.Errorf("host VolumeAttachment of %s gone while attachment pod %s is still there (%s)", lhName, p.Name, p.Status.Phase)
		}
		node, err := h.Kube.CoreV1().Nodes().Get(ctx, host, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, u := range node.Status.VolumesInUse {
			if u == corev1.UniqueVolumeName("kubernetes.io/csi/"+simlonghorn.DriverName+"^"+lhName) {
				t.Errorf("host VolumeAttachment of %s gone while %s still lists it in volumesInUse", lhName, host)
			}
		}
		return true, ""
	})
	testwait.Until(ctx, t, "the Longhorn ticket gone", func() (bool, string) {
		lva, err := h.Longhorn.VolumeAttachment(ctx, lhName)
		if err != nil {
			return false, err.Error()
		}
		return len(lva.Spec.AttachmentTickets) == 0, fmt.Sprintf("%v", lva.Spec.AttachmentTickets)
	})
}

func attachmentPod(ctx context.Context, t *testing.T, h *Host) *corev1.Pod {
	t.Helper()
	pods, err := h.Kube.CoreV1().Pods(h.Namespace).List(ctx, metav1.ListOptions{LabelSelector: kubevirtv1.AppLabel + "=hotplug-disk"})
	if err != nil {
		t.Fatal(err)
	}
	if len(pods.Items) == 0 {
		return nil
	}
	return &pods.Items[0]
}

// scheduledByScheduler looks for the scheduler's Scheduled event of pod.
func scheduledByScheduler(ctx context.Context, t *testing.T, h *Host, pod *corev1.Pod) bool {
	t.Helper()
	evs, err := h.Kube.CoreV1().Events(h.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range evs.Items {
		if e.InvolvedObject.UID == pod.UID && e.Reason == "Scheduled" && (e.Source.Component == "default-scheduler" || e.ReportingController == "default-scheduler") {
			return true
		}
	}
	return false
}

func hostVolumeAttachment(ctx context.Context, h *Host, pv string) (*storagev1.VolumeAttachment, error) {
	l, err := h.Kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for i := range l.Items {
		va := &l.Items[i]
		if va.Spec.Attacher == simlonghorn.DriverName && va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv {
			return va, nil
		}
	}
	return nil, nil
}

// The node agents of the real control plane play the release the host
// names, not the tag's (Harvester 1.8.2 runs KubeVirt 1.7.4 on v1.7.0).
func TestRealOptionsPlayRealRelease(t *testing.T) {
	h := &Host{o: Options{Real: "v1.7.0", RealRelease: "v1.7.4", Sim: kubevirtsim.Options{Scale: 0.5, Jitter: 0.2, Seed: 7}}}
	ro := h.realOptions(realkubevirt.Declarative)
	if ro.Release != "v1.7.4" || ro.Mode != realkubevirt.Declarative || ro.Scale != 0.5 || ro.Jitter != 0.2 || ro.Seed != 7 {
		t.Errorf("realOptions = %+v; want release v1.7.4, declarative, scale 0.5, jitter 0.2, seed 7", ro)
	}
}

// affinityTo reports whether pod requires node host by its hostname label,
// as KubeVirt ties an attachment pod to its virt-launcher's node.
func affinityTo(pod *corev1.Pod, host string) bool {
	a := pod.Spec.Affinity
	if a == nil || a.NodeAffinity == nil || a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return false
	}
	for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		for _, r := range term.MatchExpressions {
			if r.Key == corev1.LabelHostname && r.Operator == corev1.NodeSelectorOpIn && slices.Equal(r.Values, []string{host}) {
				return true
			}
		}
	}
	return false
}

// Harvester's server-version on KubeVirt's real control plane names the
// release that ships the KubeVirt the host plays: upstream's driver refuses
// to start without the setting.
func TestServerVersionOnTheRealControlPlane(t *testing.T) {
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{Real: "v1.7.0", RealRelease: "v1.7.4"}, "v1.8.2"},
		{Options{Real: "v1.7.0"}, "v1.8.0"},
		{Options{Real: "v1.6.0", RealRelease: "v1.6.6"}, "v1.7.2"},
		{Options{Real: "v1.6.0"}, "v1.7.0"},
		{Options{Real: "v1.8.4"}, "v1.9.0"},
		{Options{Real: "v1.7.0", Sim: kubevirtsim.Options{ServerVersion: "v1.8.1"}}, "v1.8.1"},
	} {
		if got := (&Host{o: tc.o}).serverVersion(); got != tc.want {
			t.Errorf("server-version for %+v = %q, want %q", tc.o, got, tc.want)
		}
	}
}

// kubeVirtOf is the host's KubeVirt client; the simulator's virt-api
// answers through its front proxy.
func kubeVirtOf(t *testing.T, h *Host) kubevirt.Interface {
	t.Helper()
	if h.KubeVirt != nil {
		return h.KubeVirt
	}
	kv, err := kubevirt.NewForConfig(h.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// hotplugOneVolume creates one host volume, asks KubeVirt to hot-plug it
// into vm and returns its claim (as a one-item list) and the name of the
// PV behind it, which names its Longhorn volume.
func hotplugOneVolume(ctx context.Context, t *testing.T, h *Host, kv kubevirt.Interface, vm string) ([]string, string) {
	t.Helper()
	vols, err := h.CreateVolumes(ctx, "pvc", 1)
	if err != nil {
		t.Fatal(err)
	}
	pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, vols[0], metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.KubevirtV1().VirtualMachines(h.Namespace).AddVolume(ctx, vm, &kubevirtv1.AddVolumeOptions{
		Name: vols[0], Disk: &kubevirtv1.Disk{DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: vols[0]}, Hotpluggable: true}},
	}); err != nil {
		t.Fatal(err)
	}
	return vols, pvc.Spec.VolumeName
}
