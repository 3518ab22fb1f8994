// Not a module that builds: this folder holds the one source of the three
// commands every tools/kubevirt-v*/ module builds (virt-controller, virt-api
// and the manifest generator), which each module's cmd/ links to, so that
// the modules differ only in their pins (go.mod, go.sum) and in the
// generator's manifests_v*.go of their KubeVirt line. This file only keeps
// the main module from compiling the folder. hack/tools.sh keys each build
// on the linked files' contents, not on their place.
module github.com/harvester-csi/harvester-csi-driver/tools/kubevirt-cmd

go 1.26
