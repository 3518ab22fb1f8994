package simhost

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestHardUnplugNeedsDisks(t *testing.T) {
	_, err := Start(context.Background(), Options{HardUnplug: true})
	if err == nil || !strings.Contains(err.Error(), "HardUnplug needs Disks") {
		t.Fatalf("Start with HardUnplug and no Disks: %v, want the refusal", err)
	}
}

// The builder leaves a host whose guest VMs run and whose claims bind, set
// up as an installed Harvester when asked, and Stop leaves nothing of the
// temporary directory it made.
func TestStartAssemblesAHarvester(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	h, err := Start(ctx, Options{
		Sim: kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05},
		VMs: []string{"node-0", "node-1"}, Harvester: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	dir := h.tmp
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = h.Stop(context.Background())
		}
	})
	if h.Namespace != DefaultNamespace {
		t.Errorf("namespace %q, want %q", h.Namespace, DefaultNamespace)
	}
	for _, n := range []string{"node-0", "node-1"} {
		_, vmi := h.Sim.VM(h.Namespace, n)
		if vmi == nil || vmi.Status.Phase != kubevirtv1.Running {
			t.Errorf("VMI of guest node %s: %+v, want one running", n, vmi)
		}
	}
	vols, err := h.CreateVolumes(ctx, "pvc", 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vols {
		pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, v, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pvc.Status.Phase != corev1.ClaimBound {
			t.Errorf("host PVC %s is %s, want Bound", v, pvc.Status.Phase)
		}
	}
	sc, err := h.Kube.StorageV1().StorageClasses().Get(ctx, h.StorageClass(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sc.Annotations["storageclass.kubernetes.io/is-default-class"] != "true" {
		t.Errorf("class %s is not the default: %v", sc.Name, sc.Annotations)
	}
	dyn := dynamic.NewForConfigOrDie(h.Env.Config)
	settings := schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "settings"}
	if _, err := dyn.Resource(settings).Get(ctx, onlineExpandSetting, metav1.GetOptions{}); err != nil {
		t.Errorf("setting %s: %v", onlineExpandSetting, err)
	}

	stopped = true
	if err := h.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the host's temporary directory %s is still there (%v)", dir, err)
	}
}

// With Real the same builder runs KubeVirt's own control plane: the guest
// VMs run with a boot disk as Harvester's do, claims of Harvester's class
// (and classless ones, on a Harvester) bind and grow, and a hot-plugged
// claim reaches Ready with a target through KubeVirt's controllers. The
// node agents play Harvester 1.8.2's virt-handler (KubeVirt 1.7.4) on the
// v1.7.0 control plane, as the lab's --harvester 1.8.2 --real does.
func TestStartOnTheRealControlPlane(t *testing.T) {
	const version = "v1.7.0"
	needRealKubeVirt(t, version)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	// Loop disks need root; the rest of the test does not.
	disks := os.Geteuid() == 0
	h, err := Start(ctx, Options{
		Real: version, RealRelease: "v1.7.4", Sim: kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative},
		VMs: []string{"node-0"}, Harvester: true, Disks: disks,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Stop(context.Background()); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	if h.Sim != nil || h.Real == nil {
		t.Fatalf("Sim %v, Real %v: want only the real control plane", h.Sim, h.Real)
	}
	vmi, err := h.KubeVirt.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, "node-0", metav1.GetOptions{})
	if err != nil || vmi.Status.Phase != kubevirtv1.Running || len(vmi.Spec.Volumes) != 1 {
		t.Fatalf("VMI of node-0: %v, %+v, want running with its boot disk", err, vmi)
	}
	vols, err := h.CreateVolumes(ctx, "pvc", 1)
	if err != nil {
		t.Fatal(err)
	}
	// A classless claim as the driver creates it gets Harvester's class.
	classless := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "classless", Namespace: h.Namespace},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Create(ctx, classless, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the classless claim bound", func() (bool, string) {
		pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, "classless", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return pvc.Status.Phase == corev1.ClaimBound, string(pvc.Status.Phase)
	})
	vm, err := h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Get(ctx, "node-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	spec := &vm.Spec.Template.Spec
	spec.Domain.Devices.Disks = append(spec.Domain.Devices.Disks, kubevirtv1.Disk{Name: vols[0], DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}})
	spec.Volumes = append(spec.Volumes, kubevirtv1.Volume{Name: vols[0], VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: vols[0]}, Hotpluggable: true}}})
	if _, err := h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Update(ctx, vm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the hot-plugged claim Ready", func() (bool, string) {
		vmi, err := h.KubeVirt.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, "node-0", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, e := range vmi.Status.VolumeStatus {
			if e.Name == vols[0] {
				return e.Phase == kubevirtv1.VolumeReady && e.Target != "", fmt.Sprintf("%+v", e)
			}
		}
		return false, fmt.Sprintf("no entry: %+v", vmi.Status.VolumeStatus)
	})
	if !disks {
		return
	}
	vmKey := h.Namespace + "/node-0"
	if dev, ok := h.Disks.Device(vmKey, vols[0]); !ok {
		t.Fatalf("the Ready volume %s has no loop disk", vols[0])
	} else {
		t.Logf("volume %s is %s", vols[0], dev)
	}
	// Out of the spec, the stand-in unmounts it and the disk goes.
	if vm, err = h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Get(ctx, "node-0", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	spec = &vm.Spec.Template.Spec
	spec.Domain.Devices.Disks = spec.Domain.Devices.Disks[:1]
	spec.Volumes = spec.Volumes[:1]
	if _, err := h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Update(ctx, vm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the removed volume's loop disk unplugged", func() (bool, string) {
		dev, ok := h.Disks.Device(vmKey, vols[0])
		return !ok, "still " + dev
	})
}

// needRealKubeVirt skips the test when KubeVirt's own binaries of the
// version were not built here ("" needs none).
func needRealKubeVirt(t *testing.T, version string) {
	t.Helper()
	if version == "" {
		return
	}
	bin, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	if !realkubevirt.Built(bin, version) {
		t.Skipf("KubeVirt %s binaries are not in %s: hack/tools.sh builds them", version, bin)
	}
}

// startOnHostNodes starts a host with one VM, node-0, on three host nodes
// with the host storage path (placed by placement when not nil), stopped
// when the test ends; it skips without root, which host kubelets need, or
// without KubeVirt's real binaries of real ("" runs the simulator's).
func startOnHostNodes(ctx context.Context, t *testing.T, real string, so kubevirtsim.Options, placement map[string]string) *Host {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("host kubelets mount and map block volumes: needs root")
	}
	needRealKubeVirt(t, real)
	h, err := Start(ctx, Options{
		Real: real, Sim: so,
		VMs: []string{"node-0"}, Harvester: true,
		HostStorage: true, HostNodeStatusUpdate: 2 * time.Second,
		Longhorn:  simlonghorn.Options{Scale: 0.05},
		Placement: placement,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Stop(context.Background()); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return h
}
