module github.com/hashicorp/go-getter

go 1.24
