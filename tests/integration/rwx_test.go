package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// rwxSuite is a host whose simulator plays networkfs-manager, a guest API
// server holding the pods that use RWX claims, and the controller with both.
type rwxSuite struct {
	host  *framework.Host
	guest *framework.Guest
	ctrl  *framework.Controller
	hc    *host.Client // admin, for live reads of what the driver wrote
}

func rwxCap(mode csi.VolumeCapability_AccessMode_Mode, block bool, flags ...string) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if block {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4", MountFlags: flags}}
	}
	return c
}

var rwxMount = rwxCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false)

// TestRWX runs ReadWriteMany volumes against the simulator's
// networkfs-manager on a real API server: create, publish to two VMs,
// unpublish while a guest pod still uses the claim, unpublish of the last
// user, delete, idempotency and bad input.
func TestRWX(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Scale: scale})
	s := &rwxSuite{host: h, guest: framework.StartGuest(t)}
	s.ctrl = h.StartController(t, framework.ControllerOptions{Backend: host.BackendSubresource, Queue: queueConfig(),
		Guest: s.guest.Env.Config, Driver: driver.ControllerOptions{HostStorageClass: kubevirtsim.DefaultStorageClass}})
	if !s.ctrl.Driver.RWXEnabled() {
		t.Fatal("the host lists NetworkFilesystems, but the controller does not serve RWX volumes")
	}
	var err error
	if s.hc, err = host.NewForConfig(h.Env.Config, h.Namespace); err != nil {
		t.Fatal(err)
	}
	h.CreateVMs(t, "vm-a", "vm-b")
	t.Run("CreatePublishUnpublishDelete", s.lifecycle)
	t.Run("BadInput", s.badInput)
}

func (s *rwxSuite) create(ctx context.Context, t *testing.T, name string) (string, *corev1.PersistentVolumeClaim) {
	t.Helper()
	resp, err := s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}, Parameters: map[string]string{"hostStorageClass": kubevirtsim.DefaultStorageClass}})
	if err != nil {
		t.Fatalf("create RWX volume %s: %v", name, err)
	}
	pvc, err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Get(ctx, resp.Volume.VolumeId, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Volume.VolumeId, pvc
}

func (s *rwxSuite) publish(ctx context.Context, vm, vol string) (*csi.ControllerPublishVolumeResponse, error) {
	var resp *csi.ControllerPublishVolumeResponse
	err := newAttacher(func() csi.ControllerClient { return s.ctrl.Client }).do(ctx, func(ctx context.Context, c csi.ControllerClient) error {
		var err error
		resp, err = c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: rwxMount})
		return err
	})
	return resp, err
}

// guestClaim writes the guest side of a volume as the provisioner and a
// user would: the PV of the volume bound to default/<claim>.
func (s *rwxSuite) guestClaim(ctx context.Context, t *testing.T, vol, claim string) {
	t.Helper()
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: vol},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:               corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "default", Name: claim},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver.Name, VolumeHandle: vol}},
		},
	}
	if _, err := s.guest.Kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func guestPod(ctx context.Context, t *testing.T, kube kubernetes.Interface, name, node, claim string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "busybox"}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}},
	}
	if _, err := kube.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (s *rwxSuite) lifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol, pvc := s.create(ctx, t, "pvc-rwx-life")
	if pvc.Spec.VolumeMode == nil || *pvc.Spec.VolumeMode != corev1.PersistentVolumeFilesystem || pvc.Spec.VolumeName == "" {
		t.Fatalf("host PVC %s: mode %v, volume %q; want Filesystem and bound", vol, pvc.Spec.VolumeMode, pvc.Spec.VolumeName)
	}
	fsName := pvc.Spec.VolumeName
	fs, err := s.hc.GetNetworkFS(ctx, fsName)
	if err != nil {
		t.Fatalf("NetworkFilesystem of %s: %v", vol, err)
	}
	if fs.Spec.DesiredState != host.NetworkFSDisabled || fs.Spec.NetworkFSName != fsName || fs.Spec.Provisioner != host.NetworkFSProvisioner {
		t.Fatalf("NetworkFilesystem spec %+v, want Disabled, exporting %s, provisioner Longhorn", fs.Spec, fsName)
	}
	// The provisioner retries: the same request is the same volume.
	if again, _ := s.create(ctx, t, "pvc-rwx-life"); again != vol {
		t.Fatalf("repeated create answered %s, want %s", again, vol)
	}

	var contexts []map[string]string
	for _, vm := range []string{"vm-a", "vm-b"} {
		resp, err := s.publish(ctx, vm, vol)
		if err != nil {
			t.Fatalf("publish to %s: %v", vm, err)
		}
		contexts = append(contexts, resp.GetPublishContext())
	}
	for i, pc := range contexts {
		if pc["nfsEndpoint"] != kubevirtsim.DefaultNFSEndpoint || pc["nfsExport"] != "/"+fsName {
			t.Errorf("publish %d context %v, want endpoint %s export /%s", i, pc, kubevirtsim.DefaultNFSEndpoint, fsName)
		}
	}
	if fs, _ = s.hc.GetNetworkFS(ctx, fsName); !fs.Serving() {
		t.Errorf("after publish: %s, want serving", fs.Describe())
	}
	// Nothing was hot-plugged.
	for _, vm := range []string{"vm-a", "vm-b"} {
		if got := s.ctrl.Queue.Holders(vol); len(got) > 0 {
			t.Errorf("RWX volume hot-plugged into %v", got)
		}
		vmObj, _ := s.host.Sim.VM(s.host.Namespace, vm)
		for _, v := range vmObj.Spec.Template.Spec.Volumes {
			if v.Name == vol {
				t.Errorf("VM %s has the RWX volume in its spec", vm)
			}
		}
	}
	// A repeated publish is answered from the serving export.
	if _, err := s.ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm-a", VolumeCapability: rwxMount}); err != nil {
		t.Errorf("repeated publish: %v", err)
	}

	// A pod on vm-b's node still uses the claim: unpublishing vm-a leaves
	// the export enabled.
	s.guestClaim(ctx, t, vol, "shared")
	guestPod(ctx, t, s.guest.Kube, "app-b", "node-b", "shared")
	s.waitUsers(t, vol, true)
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-a"}); err != nil {
		t.Fatalf("unpublish vm-a: %v", err)
	}
	if fs, _ = s.hc.GetNetworkFS(ctx, fsName); fs.Spec.DesiredState != host.NetworkFSEnabled {
		t.Fatalf("unpublish with a pod still using the claim disabled the export: %s", fs.Describe())
	}
	// The last user goes: the next unpublish disables it.
	if err := s.guest.Kube.CoreV1().Pods("default").Delete(ctx, "app-b", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	s.waitUsers(t, vol, false)
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-b"}); err != nil {
		t.Fatalf("unpublish vm-b: %v", err)
	}
	fs, err = s.hc.WaitNetworkFS(ctx, fsName, func(n *host.NetworkFS) bool { return n.Status.State == host.NetworkFSDisabled })
	if err != nil || fs.Spec.DesiredState != host.NetworkFSDisabled || fs.Status.Endpoint != "" {
		t.Fatalf("after the last unpublish: %v, %v; want disabled", fs, err)
	}
	// Repeated: still OK, nothing changes.
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-b"}); err != nil {
		t.Errorf("repeated unpublish: %v", err)
	}
	// Published again after being disabled: enabled again.
	if _, err := s.publish(ctx, "vm-a", vol); err != nil {
		t.Fatalf("publish after disable: %v", err)
	}
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-a"}); err != nil {
		t.Fatal(err)
	}

	// Delete: the NetworkFilesystem first, then the host PVC; twice is fine.
	for range 2 {
		if _, err := s.ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol}); err != nil {
			t.Fatalf("delete: %v", err)
		}
	}
	if _, err := s.hc.GetNetworkFS(ctx, fsName); !apierrors.IsNotFound(err) {
		t.Errorf("NetworkFilesystem after delete: %v, want NotFound", err)
	}
	if p, err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Get(ctx, vol, metav1.GetOptions{}); err == nil && p.DeletionTimestamp == nil {
		t.Errorf("host PVC %s still there after delete", vol)
	}
}

// waitUsers waits until the controller's guest pod cache agrees that the
// volume is used (or not), as the attacher's retries would.
func (s *rwxSuite) waitUsers(t *testing.T, vol string, used bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		users, err := s.ctrl.Driver.ClaimUsers(context.Background(), vol)
		if err == nil && (len(users) > 0) == used {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("guest pod cache: users %v, err %v; want used=%t", users, err, used)
		}
	}
}

func (s *rwxSuite) badInput(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	expect := func(what string, err error, want codes.Code, mentions string) {
		t.Helper()
		if status.Code(err) != want || !strings.Contains(status.Convert(err).Message(), mentions) {
			t.Errorf("%s: %v, want %s naming %q", what, err, want, mentions)
		}
	}
	_, err := s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-block",
		VolumeCapabilities: []*csi.VolumeCapability{rwxCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, true)}})
	expect("block RWX", err, codes.InvalidArgument, "block")
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-snap", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snap-1"}}}})
	expect("RWX from a snapshot", err, codes.InvalidArgument, "pvc-rwx-snap")

	other := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "not-longhorn"}, Provisioner: "other.csi.example.com"}
	if _, err := s.host.Kube.StorageV1().StorageClasses().Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-other", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		Parameters: map[string]string{"hostStorageClass": "not-longhorn"}})
	expect("RWX on a class that is not Longhorn", err, codes.InvalidArgument, "not-longhorn")
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-nope", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		Parameters: map[string]string{"hostStorageClass": "nope"}})
	expect("RWX on a missing class", err, codes.InvalidArgument, "nope")

	vol, _ := s.create(ctx, t, "pvc-rwx-size")
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-size", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}})
	expect("same name, other size", err, codes.AlreadyExists, vol)
	_, err = s.ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-rwx-missing", NodeId: "vm-a", VolumeCapability: rwxMount})
	expect("publish of a missing volume", err, codes.NotFound, "pvc-rwx-missing")
	_, err = s.ctrl.Client.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}, VolumeCapability: rwxMount})
	expect("expand RWX", err, codes.InvalidArgument, vol)

	// A single-node (block) volume is not confirmed as ReadWriteMany, and
	// cannot be published so.
	rwo, err := s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwo-block",
		VolumeCapabilities: []*csi.VolumeCapability{rwxCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true)}})
	if err != nil {
		t.Fatal(err)
	}
	id := rwo.Volume.VolumeId
	v, err := s.ctrl.Client.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{rwxMount}})
	if err != nil || v.GetConfirmed() != nil || !strings.Contains(v.GetMessage(), id) {
		t.Errorf("validate RWX on a block volume: %v, %v; want unconfirmed with a message naming it", v, err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		_, err = s.ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "vm-a", VolumeCapability: rwxMount})
		if status.Code(err) != codes.Aborted || time.Now().After(deadline) { // Aborted: not bound yet
			break
		}
	}
	expect("RWX publish of a block volume", err, codes.FailedPrecondition, id)
}
