package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	guestpkg "github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestRealExternalAttacher runs the upstream external-attacher against a
// guest API server and the driver's controller: VolumeAttachments created at
// once for one node all end attached (each volume Ready on the VM), and
// deleting them detaches every volume and releases the finalizers. With the
// attacher's reconciler on, a volume that KubeVirt loses behind the
// VolumeAttachment's back (harvester 10588) is found through ListVolumes and
// attached again, and volumes that did not drift are left alone.
func TestRealExternalAttacher(t *testing.T) {
	for _, mode := range []kubevirtsim.Mode{kubevirtsim.ModeLegacy, kubevirtsim.ModeDeclarative} {
		t.Run(string(mode), func(t *testing.T) { realAttacher(t, mode) })
	}
}

func realAttacher(t *testing.T, mode kubevirtsim.Mode) {
	const n = 12
	h := framework.StartHost(t, kubevirtsim.Options{Mode: mode, Version: kubevirtsim.V1_7_0, Scale: 0.05, BindClasslessPVCs: true})
	vm := "guest-node-1"
	h.CreateVMs(t, vm)
	vols := h.CreateVolumes(t, "pvc-att", n)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 100 * time.Millisecond, MaxHold: 1500 * time.Millisecond}})

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	guestEnv, guest := g.Env, g.Kube

	// The attacher maps a node name to the CSI node ID (the VM name) through
	// CSINode, as the node-driver-registrar would have registered it.
	nodeName := "rke2-worker-1"
	registerNode(ctx, t, guest, nodeName, vm, vols)
	runAttacher(t, guestEnv, ctrl.Endpoint, "--timeout=20s", "--worker-threads=50", "--leader-election=false", "--reconcile-sync=1s", "--v=2")

	attachAll(ctx, t, h, guest, nodeName, vm, vols)
	kv := kubevirt.NewForConfigOrDie(h.Env.Config)

	// Someone takes one volume off the VM behind the VolumeAttachment's back.
	// Only the attacher's reconciler, reading ListVolumes, can notice.
	lost := vols[0]
	h.Sim.ResetStats()
	viaAPI := kubevirt.NewForConfigOrDie(h.Sim.ClientConfig()) // virt-api's subresources live behind the simulator's proxy
	if err := viaAPI.KubevirtV1().VirtualMachines(h.Namespace).RemoveVolume(ctx, vm, &kubevirtv1.RemoveVolumeOptions{Name: lost}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the lost volume gone from the VMI", func() (bool, string) {
		vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		e, ok := kubevirtsim.FindVolumeStatus(vmi, lost)
		return !ok, fmt.Sprintf("%+v", e)
	})
	testwait.Until(ctx, t, "the lost volume attached again", func() (bool, string) {
		vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		e, ok := kubevirtsim.FindVolumeStatus(vmi, lost)
		return ok && e.Phase == kubevirtv1.VolumeReady && e.Target != "", fmt.Sprintf("%+v", e)
	})
	if st := h.Sim.Stats(); st.RemoveVolume > 1 {
		t.Errorf("the repair removed volumes: %+v", st)
	}
	vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, vol := range vols {
		if e, ok := kubevirtsim.FindVolumeStatus(vmi, vol); !ok || e.Phase != kubevirtv1.VolumeReady {
			t.Errorf("after the repair %s is %+v", vol, e)
		}
	}

	detachAll(ctx, t, guest, vols)
	vmi, err = kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, vol := range vols {
		if e, ok := kubevirtsim.FindVolumeStatus(vmi, vol); ok {
			t.Errorf("VolumeAttachment of %s is gone but the VMI still has %+v", vol, e)
		}
	}
}

// registerNode creates guest Node nodeName on VM vm and its CSINode, as the
// node-driver-registrar would have registered it (the external-attacher
// maps a node name to the CSI node ID through it), and a guest PV per
// volume.
func registerNode(ctx context.Context, t *testing.T, guest kubernetes.Interface, nodeName, vm string, vols []string) {
	t.Helper()
	mustCreate(t, func() error {
		_, err := guest.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{})
		return err
	})
	mustCreate(t, func() error {
		_, err := guest.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
			ObjectMeta: metav1.ObjectMeta{Name: nodeName},
			Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver.Name, NodeID: vm}}},
		}, metav1.CreateOptions{})
		return err
	})
	createGuestPVs(ctx, t, guest, vols)
}

// createGuestPVs creates a guest PV per volume, as the provisioner would have.
func createGuestPVs(ctx context.Context, t *testing.T, guest kubernetes.Interface, vols []string) {
	t.Helper()
	for _, vol := range vols {
		mustCreate(t, func() error {
			_, err := guest.CoreV1().PersistentVolumes().Create(ctx, guestPV(vol), metav1.CreateOptions{})
			return err
		})
	}
}

// runAttacher runs the external-attacher in env against the driver's
// controller at endpoint; flags come after its address and kubeconfig.
func runAttacher(t *testing.T, env *testenv.Env, endpoint string, flags ...string) {
	t.Helper()
	args := append([]string{"--csi-address=" + strings.TrimPrefix(endpoint, "unix://"), "--kubeconfig=" + env.Kubeconfig}, flags...)
	if err := env.Run("csi-attacher", args...); err != nil {
		t.Fatal(err)
	}
}

// createAttachment creates the VolumeAttachment the attach/detach controller
// would for vol on node, under the name it would give it, and returns that
// name.
func createAttachment(ctx context.Context, t *testing.T, guest kubernetes.Interface, vol, node string) string {
	t.Helper()
	name := guestpkg.AttachmentName(vol, driver.Name, node)
	mustCreate(t, func() error {
		_, err := guest.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: node,
				Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &vol}},
		}, metav1.CreateOptions{})
		return err
	})
	return name
}

// attachAll creates a VolumeAttachment per volume for nodeName, as the
// attach/detach controller would, waits until the external-attacher reports
// every one attached, and checks that the VMI of vm shows each volume with a
// target: an attached VolumeAttachment must mean a disk in the guest.
func attachAll(ctx context.Context, t *testing.T, h *framework.Host, guest kubernetes.Interface, nodeName, vm string, vols []string) {
	t.Helper()
	for _, vol := range vols {
		mustCreate(t, func() error {
			_, err := guest.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{
				ObjectMeta: metav1.ObjectMeta{Name: "csi-" + vol},
				Spec: storagev1.VolumeAttachmentSpec{
					Attacher: driver.Name, NodeName: nodeName,
					Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &vol},
				},
			}, metav1.CreateOptions{})
			return err
		})
	}
	n := len(vols)
	testwait.Until(ctx, t, "every VolumeAttachment attached", func() (bool, string) {
		list, err := guest.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		attached, lastErr := 0, ""
		for _, va := range list.Items {
			if va.Status.Attached {
				attached++
			} else if va.Status.AttachError != nil {
				lastErr = va.Status.AttachError.Message
			}
		}
		return attached == n, fmt.Sprintf("%d/%d attached, last error %q", attached, n, lastErr)
	})
	kv := kubevirt.NewForConfigOrDie(h.Env.Config)
	vmi, err := kv.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, vol := range vols {
		if e, ok := kubevirtsim.FindVolumeStatus(vmi, vol); !ok || e.Target == "" {
			t.Errorf("VolumeAttachment of %s says attached but the VMI shows %+v", vol, e)
		}
	}
}

// detachAll deletes the VolumeAttachments of attachAll and waits until the
// external-attacher has detached each and released its finalizer.
func detachAll(ctx context.Context, t *testing.T, guest kubernetes.Interface, vols []string) {
	t.Helper()
	for _, vol := range vols {
		if err := guest.StorageV1().VolumeAttachments().Delete(ctx, "csi-"+vol, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(ctx, t, "every VolumeAttachment detached and deleted", func() (bool, string) {
		list, err := guest.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		return len(list.Items) == 0, fmt.Sprintf("%d left", len(list.Items))
	})
}

func guestPV(name string) *corev1.PersistentVolume {
	return &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: driver.Name, VolumeHandle: name, FSType: "ext4",
			}},
		},
	}
}

func mustCreate(t *testing.T, create func() error) {
	t.Helper()
	if err := create(); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
}
